"""The resume oracle: what a launcher is told after a failure.

Loads the run's steps and training health from the catalog, lets :class:`ckptd.policy.ResumePolicy`
choose, and answers with everything a relaunch needs. The chosen step is leased for a while so
retention cannot delete it between the answer and the restarted job loading it.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptd import runlayout, stepname
from ckptd.catalog import nodes as node_registry
from ckptd.catalog.models import Checkpoint, Shard, StepHealth, StrategyFile, as_utc
from ckptd.errors import CkptdError
from ckptd.policy import Health, ResumePolicy, SpikeRule, StepInfo
from ckptd.service import tracker
from ckptd.catalog import reads
from ckptd.catalog.reads import shards_step_column
from ckptd.service.catalog import get_run
from ckptd.split import ParallelSplit
from ckptd.service import resume_tiers
from ckptd.states import ShardState, StepState, Tier
from ckptd.storage import ConfinementError, PosixStorage

RESUME_LEASE = timedelta(minutes=30)


class NoRestorableStepError(CkptdError):
    code = "no_restorable_step"
    default_hint = "nothing verified to resume from: start fresh only if that is intended (ckptd launch --allow-fresh-start)"


@dataclass(frozen=True)
class ResumeOptions:
    max_step: int | None = None
    world_size: int | None = None  # target layout: a different world size needs a conversion
    skip_spikes: bool = False
    spike_factor: float = 3.0
    spike_window: int = 20
    lease: bool = True
    # target layout by strategy hash: tells apart layouts of one world size (tp2dp2 vs tp4dp1)
    strategy_hash: str | None = None
    # skip steps with a shard on a node whose daemon is silent (the launcher's choice after a node loss)
    exclude_unreachable: bool = False
    node_timeout: float = 120.0
    #: the job's tp/dp/pp split: ckptd derives the strategy its conversion of the answered step would
    #: have and says whether one is needed and whether a copy is ready (the launcher derives nothing)
    split: ParallelSplit | None = None
    #: the ``allow_hardlinks`` setting: a strategy file with more than one name is served only with it
    hardlinks: bool = False
    #: the tiers the asker can load from (``resume_tiers``); ``memory_root``: where this daemon's slots are
    tiers: tuple[Tier, ...] = resume_tiers.DEFAULT_TIERS
    memory_root: str | None = None


def step_infos(s: Session, run_id: int, now: datetime, limit: int | None = None) -> list[StepInfo]:
    """The run's trained steps, newest first (plain column rows: this is the oracle's hot path).
    Only ``trained`` rows: converted copies are served through their source step, and the history
    rows of re-saved steps (kind ``superseded``, see :mod:`ckptd.states`) are never steps. A step is
    its global step (:mod:`ckptd.stepname`); where the file names count otherwise, that is said."""
    q = (
        select(Checkpoint.id, Checkpoint.epoch, Checkpoint.step, Checkpoint.incarnation, Checkpoint.global_step,
               Checkpoint.state, Checkpoint.reason, Checkpoint.marked_bad, Checkpoint.bad_reason, Checkpoint.pinned,
               Checkpoint.lease_until, Checkpoint.health_reason, shards_step_column())
        .where(Checkpoint.run_id == run_id, Checkpoint.kind == "trained")
        .order_by(Checkpoint.epoch.desc(), Checkpoint.step.desc(), Checkpoint.incarnation.desc())
    )
    if limit is not None:
        q = q.limit(limit)
    out = []
    for cid, epoch, step, incarnation, gstep, state, reason, bad, bad_reason, pinned, lease, health, seen in \
            s.execute(q).all():
        users = stepname.users_step(gstep, seen, epoch, step)
        out.append(StepInfo(id=cid, step=users if users is not None else step, state=state, reason=reason,
                            marked_bad=bool(bad), bad_reason=bad_reason, pinned=bool(pinned),
                            in_use=lease is not None and as_utc(lease) > now, health_reason=health,
                            position=(epoch, step, incarnation or 0),
                            named=stepname.file_name_note(epoch, step, users)))
    return out


_FIRST_BATCH = 64  # the answer is almost always among the newest few steps


def _health(s: Session, run_id: int, spikes: bool) -> list[Health]:
    """What the policy needs: without spike detection only the first non-finite loss matters."""
    if spikes:
        from ckptd.service.catalog import health_rows

        return [Health(step, loss, gn, bool(ov)) for step, loss, gn, ov in health_rows(s, run_id)]
    first = s.execute(
        select(StepHealth.step, StepHealth.loss_nonfinite)
        .where(StepHealth.run_id == run_id, StepHealth.loss_nonfinite.is_not(None))
        .order_by(StepHealth.step)
        .limit(1)
    ).first()
    return [Health(first[0], float(first[1]))] if first else []


def resume(s: Session, run_name: str, opts: ResumeOptions = ResumeOptions()) -> dict[str, Any]:
    """The resume answer (stable keys; see docs/API.md). Raises NoRestorableStepError if none."""
    run = get_run(s, run_name)
    now = datetime.now(UTC)
    spike = SpikeRule(opts.spike_factor, opts.spike_window) if opts.skip_spikes else None
    policy = ResumePolicy(max_step=opts.max_step, spike=spike)
    health = _health(s, run.id, opts.skip_spikes)
    dead = node_registry.unreachable(s, opts.node_timeout)
    tiers = opts.tiers if opts.memory_root is not None else tuple(t for t in opts.tiers if t is not Tier.MEMORY)
    wanted_world = opts.split.world if opts.split is not None else opts.world_size
    if runlayout.by_name(run.layout).iterations:
        mem, obj = {}, {}  # Checkpoint 2.0 runs resume through MindFormers' own loader: files only
    else:
        mem, obj = resume_tiers.other_tier_steps(s, run.id, dead, tiers, wanted_world)
    if mem and opts.split is not None:  # a slot holds the saved split's slices: no conversion from RAM
        mem = {k: v for k, v in mem.items() if not _needs_conversion(s, k, opts.split, opts.hardlinks, run.path)}
    other = {**obj, **mem}  # the policy sees both alike; the answer below says which tier
    files = _mark_unreachable(s, step_infos(s, run.id, now, limit=_FIRST_BATCH), dead, opts)
    steps = resume_tiers.with_memory(files, other)
    decision = policy.decide(steps, health)
    if decision.chosen is None and len(steps) == _FIRST_BATCH:
        files = _mark_unreachable(s, step_infos(s, run.id, now), dead, opts)
        steps = resume_tiers.with_memory(files, other)
        decision = policy.decide(steps, health)
    skipped = [{"step": step, "reason": reason} for step, reason in decision.skipped]
    if decision.chosen is None:
        err = NoRestorableStepError(f"run {run_name!r} has no restorable step" + (
            f" at or before step {opts.max_step}" if opts.max_step is not None else ""))
        err.skipped = skipped  # type: ignore[attr-defined]
        err.unjudged, err.unjudged_unreachable = _unjudged(s, steps, decision.unjudged, dead)  # type: ignore[attr-defined]
        raise err
    ckpt = s.get(Checkpoint, decision.chosen.id)
    assert ckpt is not None
    rows = s.execute(
        select(Shard.rank, Shard.path, Shard.node).where(Shard.checkpoint_id == ckpt.id, Shard.state == ShardState.VERIFIED.value)
        .order_by(Shard.rank)
    ).all()
    shards = [(rank, path) for rank, path, _ in rows]
    node_of = {path: node for _, path, node in rows}
    strategy = s.get(StrategyFile, ckpt.strategy_id) if ckpt.strategy_id else None
    store = PosixStorage(os.path.dirname(run.path), opts.hardlinks)  # the root the run was seen under
    strategy_path = strategy.path if strategy and _servable(store, strategy.path) else None
    lease = as_utc(ckpt.lease_until) if ckpt.lease_until is not None else None
    layout = runlayout.by_name(run.layout)
    if opts.lease and (lease is None or lease < now + RESUME_LEASE / 2):
        ckpt.lease_until = now + RESUME_LEASE  # renewed at most every 15 min: polling stays read-only
    answer: dict[str, Any] = {
        "run": run.name,
        "step": decision.chosen.step,
        "epoch": ckpt.epoch,
        "global_step": ckpt.global_step,
        "name_step": ckpt.step,
        "prefix": ckpt.prefix,
        "incarnation": ckpt.incarnation,
        "layout": layout.name,
        "world_size": ckpt.expected_ranks,
        "strategy_file": strategy_path,
        "strategy_hash": strategy.content_hash if strategy else None,
        "reason": ckpt.reason,  # what the step's checks could not prove ("layout unchecked: …"), else null
        "tier": Tier.FILE.value,
        "files_whole": None,  # memory answers say whether the files are whole too
        "manifest": None,  # object answers: the step's manifest (s3:// URI)
        "shards": load_entries(dict(shards), ckpt.expected_ranks, ckpt.load_plan, node_of),
        "unreachable_nodes": sorted({n for n in node_of.values() if n in dead}),
        "skipped": skipped,
        "split": str(opts.split) if opts.split is not None else None,  # echoed: the question was understood
        "conversion": None,
        "mindformers": mindformers_block(layout, run.path, dict(shards), ckpt) if layout.mindformers_resume else None,
    }
    # whether the step's files can be answered is the policy's view of them (an unreachable node's
    # files are not, with exclude_unreachable), not the row's state
    files_whole = any(i.id == ckpt.id and i.state == StepState.VERIFIED.value for i in files)
    if ckpt.id in obj and not files_whole and ckpt.id not in mem:
        answer.update(resume_tiers.object_answer(obj[ckpt.id], run.name, run.path, stepname.filed_step(ckpt.global_step, ckpt.step),
                                                 ckpt.incarnation))
        return answer
    if ckpt.id in mem:
        # the restart loads from RAM; a step whose files are whole too keeps them as the fallback
        answer.update(tier=Tier.MEMORY.value, shards=resume_tiers.memory_shards(mem[ckpt.id], opts.memory_root or ""),
                      unreachable_nodes=[], mindformers=None, files_whole=files_whole)
        return answer
    if layout.iterations:
        return _iteration_answer(answer, store, run.path, ckpt, rows, steps, s)
    if opts.split is not None:
        answer["conversion"] = _split_conversion(s, ckpt, strategy, opts.split, store)
        return answer
    other_world = opts.world_size is not None and opts.world_size != ckpt.expected_ranks
    other_layout = opts.strategy_hash is not None and opts.strategy_hash != answer["strategy_hash"]
    if other_world or other_layout:
        answer["conversion"] = _conversion_info(s, ckpt, opts.world_size, opts.strategy_hash, store)
    return answer


def _servable(store: PosixStorage, path: str) -> bool:
    """A path served is one the trainer will open: here it must still be a regular file (or, for
    per-rank strategy files merged, their real directory) reached without symlinks — it may have
    been swapped since it was read; the hash still names the layout. One not on this node's disk
    is another node's to judge."""
    st = store.stat(path)
    if st is None:
        return True
    if stat.S_ISDIR(st.st_mode):  # MindFormers' strategy/ of per-rank files
        try:
            store.check_dir(path)
            return True
        except (ConfinementError, OSError):
            return False
    return store.is_file(path)


def _unjudged(s: Session, steps: list[StepInfo], unjudged: tuple[int, ...], dead: set[str],
              ) -> tuple[list[int], dict[str, list[str]]]:
    """The passed-over steps still awaiting a verdict, split: those a reachable daemon will judge
    (wait for it), and those whose unjudged shards are all on nodes whose daemon is silent (step ->
    those nodes: nobody judges them until a node comes back)."""
    if not unjudged or not dead:
        return list(unjudged), {}
    waiting = set(unjudged)
    ids = {i.id: i.step for i in steps if i.step in waiting and i.state == "pending"}
    blocked = {ids[cid]: sorted(n for n in nodes if n) for cid, nodes in reads.unverified_shard_nodes(s, list(ids)).items()
               if nodes and all(n in dead for n in nodes)}
    return [u for u in unjudged if u not in blocked], {str(k): v for k, v in sorted(blocked.items())}


def _mark_unreachable(s: Session, steps: list[StepInfo], dead: set[str], opts: ResumeOptions) -> list[StepInfo]:
    """With ``exclude_unreachable``, steps with a shard on an unreachable node are passed over
    (with that reason); without it they stay candidates and the answer names the nodes."""
    if not dead or not opts.exclude_unreachable or not steps:
        return steps
    hit: dict[int, set[str]] = {}
    ids = [i.id for i in steps]
    for ckpt_id, node in s.execute(select(Shard.checkpoint_id, Shard.node).where(
            Shard.checkpoint_id.in_(ids), Shard.node.in_(sorted(dead))).distinct()).all():
        hit.setdefault(ckpt_id, set()).add(node)
    return [replace(i, state=f"unreachable: shards on node(s) {', '.join(sorted(hit[i.id]))}, whose daemon is silent")
            if i.id in hit and i.state == "verified" else i for i in steps]


def load_entries(own: dict[int, str], world: int | None, load_plan: str | None,
                 node_of: dict[str, str | None] | None = None) -> list[dict[str, Any]]:
    """One entry per rank: the file it loads. A step whole only as the union of its files (see
    ``ckptd.service.stepcheck``) also lists, per rank, every file holding its slices (``load_from``);
    a rank without a file of its own gets the first of those as its ``path`` (``own_file`` false)."""
    plan = {int(r): src for r, src in json.loads(load_plan).items()} if load_plan else {}
    entries = []
    for rank in sorted(set(own) | set(plan) | set(range(world or 0) if plan else ())):
        sources = [own[r] for r in plan.get(rank, [rank]) if r in own]
        if not sources:
            continue
        path = own.get(rank, sources[0])
        entry: dict[str, Any] = {"rank": rank, "path": path, "node": (node_of or {}).get(path)}
        if plan:
            entry["own_file"] = rank in own
            entry["load_from"] = sources
        entries.append(entry)
    return entries


def mindformers_block(layout: runlayout.RunLayout, run_path: str, own: dict[int, str],
                      ckpt: Checkpoint) -> dict[str, Any]:
    """What MindFormers' own resume needs to load exactly this step: ``load_checkpoint`` (the
    directory of ``rank_<r>/``) and ``resume_training`` (a file name; MindFormers substitutes each
    rank's ``_rank_<r>``). ``loadable_by_mindformers`` is false when some rank has no file of its
    own (a subset save): MindFormers' loader would then fail — load per ``shards[].load_from``."""
    first = min(own) if own else None
    return {
        "load_checkpoint": layout.rank_base(run_path),
        "resume_training": os.path.basename(own[first]) if first is not None else None,
        "loadable_by_mindformers": ckpt.expected_ranks is not None and set(own) >= set(range(ckpt.expected_ranks)),
        "remove_redundancy": bool(ckpt.load_plan) and set(own) >= set(range(ckpt.expected_ranks or 0)),
    }


def _iteration_answer(answer: dict[str, Any], store: PosixStorage, run_path: str, ckpt: Checkpoint, rows: list, steps: list[StepInfo],
                      s: Session) -> dict[str, Any]:
    """A Checkpoint 2.0 iteration: its files (``rank`` is the file's slot, ``role`` says which),
    where MindFormers loads it from, and what the tracker says. MindFormers re-shards 2.0
    checkpoints into the running layout itself, so there is no world size and no conversion."""
    answer["world_size"] = None
    answer["shards"] = [{"rank": rank, "path": path, "node": node, "role": runlayout.slot_role(rank)[0]}
                        for rank, path, node in rows]
    states = {st.step: (st.state, st.reason) for st in steps}
    answer["mindformers"] = {
        "load_checkpoint": runlayout.iteration_dir(run_path, ckpt.step),
        "resume_training": True,
        "loadable_by_mindformers": True,
        "remove_redundancy": False,
        "checkpoint_dir": os.path.dirname(runlayout.tracker_path(run_path)),
        "tracker": tracker.judge(store, tracker.read(store, run_path), ckpt.step, states, run_path),
    }
    return answer


def _needs_conversion(s: Session, ckpt_id: int, split: ParallelSplit, hardlinks: bool, run_path: str) -> bool:
    ckpt = s.get(Checkpoint, ckpt_id)
    assert ckpt is not None
    strategy = s.get(StrategyFile, ckpt.strategy_id) if ckpt.strategy_id else None
    return _split_conversion(s, ckpt, strategy, split, PosixStorage(os.path.dirname(run_path), hardlinks)) is not None


def _split_conversion(s: Session, ckpt: Checkpoint, strategy: StrategyFile | None, split: ParallelSplit,
                      store: PosixStorage) -> dict[str, Any] | None:
    """The ``conversion`` block for a job of ``split``: None when the step is already in it; else
    the target's strategy hash (what ``to_layout=<split>`` derives from the strategy the step was
    saved with, as catalogued), the ready copy of exactly that layout if any, or why none can be
    made (``impossible``)."""
    from ckptd.service.conversions import split_target

    target = split_target(strategy, ckpt.expected_ranks, split)
    if not target.needed:
        return None
    if target.impossible is not None:
        return {"needed": True, "from_world_size": ckpt.expected_ranks, "to_world_size": split.world,
                "existing": None, "target_strategy_hash": None, "impossible": target.impossible,
                "hint": "convert it with ckptd convert --to-strategy FILE, or launch in the saved split"}
    return _conversion_info(s, ckpt, split.world, target.hash, store)


def _conversion_info(s: Session, ckpt: Checkpoint, world_size: int | None, strategy_hash: str | None,
                     store: PosixStorage) -> dict[str, Any]:
    """Another target layout needs the checkpoint re-sharded; point at a ready copy if any — of
    exactly that layout when the strategy hash is given, else the newest copy for that world size.
    A copy is ready while the daemon holds it verified (its rescan follows the files: a lost
    copy becomes ``deleted`` and is not offered); its ``strategy_file`` is served like the
    step's own (``_servable``: a regular file reached without symlinks, else null)."""
    q = select(Checkpoint).where(
        Checkpoint.derived_from_id == ckpt.id, Checkpoint.kind == "converted", Checkpoint.state == "verified")
    if strategy_hash is not None:
        q = q.where(Checkpoint.strategy_hash == strategy_hash)
    if world_size is not None:
        q = q.where(Checkpoint.expected_ranks == world_size)
    copies = s.execute(q.order_by(Checkpoint.id.desc())).scalars().all()
    existing = None
    if copies:
        copy = copies[0]
        paths = s.execute(select(Shard.rank, Shard.path).where(
            Shard.checkpoint_id == copy.id, Shard.state == ShardState.VERIFIED.value).order_by(Shard.rank)).all()
        strat = s.get(StrategyFile, copy.strategy_id) if copy.strategy_id else None
        served = strat.path if strat and _servable(store, strat.path) else None
        existing = {"shards": [{"rank": r, "path": p} for r, p in paths], "strategy_file": served,
                    "strategy_hash": copy.strategy_hash}
    return {
        "needed": True,
        "from_world_size": ckpt.expected_ranks,
        "to_world_size": world_size if world_size is not None else (copies[0].expected_ranks if copies else None),
        "existing": existing,
        "target_strategy_hash": strategy_hash,  # the layout asked for (by hash, or derived from a split)
        "impossible": None,
        "hint": None if existing else ("POST /v1/runs/{run}/conversions {\"step\": S, \"to_layout\": \"tp=..,dp=..\"} "
                                        "or `ckptd convert --run R --step S --to-layout tp=..,dp=..`"),
    }
