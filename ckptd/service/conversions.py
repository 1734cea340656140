"""Conversions of catalogued checkpoints, registered as derived checkpoints with lineage.

``convert_step`` re-shards one verified step of a run (through :mod:`ckptd.convert`, which writes
atomically and verifies every slice) into ``<root>/<run>/converted/<step>-<target hash>/`` — a
place the watcher never mistakes for training shards — and records the result as a ``converted``
checkpoint (``derived_from_id`` → the source step; target strategy registered) plus a
``conversion_jobs`` row holding both strategy hashes. The resume oracle then serves it to a job
restarting on the target layout. The source step is leased while it is being read. The copy is
written through a descriptor of its output directory and catalogued from what was written
(:mod:`ckptd.service.converted`: also when a lost copy is replaced and when an existing one blocks).

Every conversion runs as a job (:mod:`ckptd.service.jobs`: the API's job, or one ``convert_step``
records for ``ckptd convert --run``), which names the process running it and carries its
heartbeat. A conversion whose process died (SIGKILL, power loss) is failed by
:func:`recover_conversions` — through :func:`ckptd.service.jobs.recover_abandoned`, at daemon
start — its source's lease is cut back to what a resume answer may still need, and the temp tree
it was writing (``OUT/.ckptd-convert-<host>-<pid>-<hex>``) is removed: only that tree, only
inside the checkpoint root, reached without following a symlink.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.catalog import jobrows, repo
from ckptd.catalog.models import Checkpoint, ConversionJob, Job, Run, StrategyFile, as_utc
from ckptd.convert.iteration_source import iteration_source
from ckptd.errors import CkptdError
from ckptd.format.strategy import MAX_STRATEGY_BYTES, Strategy, encode_strategy, load_strategy, parse_strategy_bytes
from ckptd.service import converted, jobs
from ckptd.service.catalog import InvalidRequestError, iso_time, get_run, get_step
from ckptd.service.verifier import stat_of
from ckptd.split import ParallelSplit
from ckptd.states import ShardState, StepState
from ckptd.storage import ConfinementError, PosixStorage
from ckptd.storage.dirs import Dir

CONVERT_LEASE = timedelta(hours=2)
log = logging.getLogger("ckptd.conversions")


def check_source(s: Session, run_name: str, step: int) -> tuple[Checkpoint, dict[int, str], StrategyFile | None]:
    """The verified save of ``step`` to convert, its verified files by rank and its strategy row.
    Refuses (400) a step with no verified save, saying what each save of it is and why."""
    run = get_run(s, run_name)
    ckpt = get_step(s, run, step)
    if ckpt.state != StepState.VERIFIED.value:
        saves = _saves_of(s, run, step)
        verified = [c for c in saves if c.state == StepState.VERIFIED.value]
        if not verified:
            raise InvalidRequestError(_not_restorable(s, run_name, step, saves or [ckpt]),
                                      hint="convert a restorable step (see `ckptd ls RUN --state verified`)")
        ckpt = verified[0]  # two saves of one step (a restart): the restorable one is meant
    files = jobrows.verified_files(s, ckpt.id)
    strategy = s.get(StrategyFile, ckpt.strategy_id) if ckpt.strategy_id else None
    return ckpt, files, strategy


def check_request(s: Session, store: PosixStorage, run_name: str, step: int, *, split: ParallelSplit | None,
                  to_strategy: str | None) -> None:
    """Everything wrong with a conversion request that is known before a job runs, refused (400 /
    404) before one is queued: both or neither target, a ``to_strategy`` outside the root, no
    verified save of ``step``, and a split the derivation refuses or whose output would exceed the
    bytes bound (:func:`_check_layout_bytes`). (A split's text was parsed at the edge.)"""
    if (split is None) == (to_strategy is None):
        raise InvalidRequestError("give exactly one of to_layout / to_strategy")
    if to_strategy not in (None, "none") and not runlayout.resolves_inside(store.root, to_strategy):
        raise InvalidRequestError("to_strategy must be a file inside the checkpoint root", hint="copy it under the run directory")
    ckpt, _, strat_row = check_source(s, run_name, step)
    if split is not None:
        _check_layout_bytes(s, ckpt, strat_row, split)


def _check_layout_bytes(s: Session, ckpt: Checkpoint, strat_row: StrategyFile | None, split: ParallelSplit) -> None:
    """The planner's bytes bound (:func:`ckptd.convert.plan.output_bytes_bound`) on a ``to_layout``
    target, estimated from the catalog: the step's verified file sizes and the strategy it was saved
    with (:func:`ckptd.convert.plan.least_output_bytes`). A Checkpoint 2.0 step's layout is in its
    files' ``metadata.json``, and a strategy row without content is a file to read: both are left to
    the job, whose planner applies the same bound exactly."""
    from ckptd.convert import derive_strategy
    from ckptd.convert.plan import check_output_bytes, least_output_bytes

    if strat_row is None or strat_row.content is None or runlayout.by_name(repo.run_layout(s, ckpt)).iterations:
        return
    try:
        src = parse_strategy_bytes(strat_row.content, strat_row.path)
    except CkptdError:
        return  # the job says what is wrong with the strategy it was saved with
    try:
        dst = derive_strategy(src, split.tp, split.dp, split.pp)
        source_bytes = jobrows.verified_bytes(s, ckpt.id)
        check_output_bytes(least_output_bytes(source_bytes, src, dst), source_bytes, dst.world_size, estimated=True)
    except CkptdError as err:
        raise InvalidRequestError(f"to_layout {str(split)!r}: {err.message}", hint=err.hint) from None


def _saves_of(s: Session, run: Run, step: int) -> list[Checkpoint]:
    """Every trained save ``get_step`` could mean by ``step``, newest first."""
    return jobrows.trained_saves(s, run.id, step)


def _state_detail(s: Session, ckpt: Checkpoint) -> str:
    """What keeps a save from being restorable, in the words of its state."""
    state = ckpt.state
    ranks = jobrows.rank_states(s, ckpt.id)
    if state == StepState.INCOMPLETE.value:
        present = {r for r, st in ranks.items() if st != ShardState.DELETED.value}
        if ckpt.reason:
            return ckpt.reason
        if ckpt.expected_ranks:
            missing = sorted(set(range(ckpt.expected_ranks)) - present)
            return f"ranks {missing} of {ckpt.expected_ranks} have no file" if missing else "not every rank's file is present"
        return "not every rank's file is present (the world size is not known yet)"
    if state == StepState.PENDING.value:
        return "its verification has not finished"
    if state == StepState.CORRUPT.value:
        return ckpt.reason or "a shard failed verification"
    if state == StepState.DELETED.value:
        gone = sorted(r for r, st in ranks.items() if st == ShardState.DELETED.value)
        return f"the files of ranks {gone} are gone" if gone else "a shard file is gone"
    if state == StepState.DELETING.value:
        return "retention is deleting it"
    return ckpt.reason or state


def _not_restorable(s: Session, run_name: str, step: int, saves: list[Checkpoint]) -> str:
    if len(saves) == 1:
        return f"step {step} of run {run_name!r} is {saves[0].state}, not verified: {_state_detail(s, saves[0])}"
    parts = [("the newest save" if i == 0 else "the save") + f" (epoch {c.epoch}"
             + (f", incarnation {c.incarnation}" if c.incarnation else "") + f") is {c.state}: {_state_detail(s, c)}"
             for i, c in enumerate(saves)]
    return f"step {step} of run {run_name!r} has {len(saves)} saves and none is verified: " + "; ".join(parts)


@dataclass(frozen=True)
class SplitTarget:
    """What a step must be converted to for a job of a given split."""

    needed: bool
    hash: str | None = None  # the target strategy's content hash (what the copy is catalogued under)
    impossible: str | None = None  # why no conversion can produce it


def split_target(strategy: StrategyFile | None, world: int | None, split: ParallelSplit) -> SplitTarget:
    """The conversion ``to_layout=<split>`` of a step saved with ``strategy`` (its catalogued row:
    the content it was saved with, whatever the file holds now) over ``world`` ranks: not needed
    when the derived strategy places every slice as the saved one does; a step without a strategy
    is data parallel, usable as it is by a job of the same world size and by no other."""
    from ckptd.convert import derive_strategy
    from ckptd.convert.layouts import same_placement

    if strategy is None or strategy.content is None:
        if world is None or split.world == world:
            return SplitTarget(False)
        return SplitTarget(True, impossible=f"saved with world size {world} and ckptd has no strategy file for it, so "
                                            f"it cannot be re-sharded for {split} (put the job's strategy file in the "
                                            f"run directory, or launch with world size {world})")
    try:
        src = parse_strategy_bytes(strategy.content, strategy.path)
        dst = derive_strategy(src, split.tp, split.dp, split.pp)
    except CkptdError as err:
        return SplitTarget(True, impossible=f"cannot be re-sharded for {split}: {err.message} "
                                            f"({err.hint or 'convert it with ckptd convert --to-strategy'})")
    if split.world == world and same_placement(src, dst):
        return SplitTarget(False)
    return SplitTarget(True, dst.content_hash())


def resolve_target(src: Strategy | None, to_strategy: str | None, split: ParallelSplit | None,
                   store: PosixStorage) -> Strategy | None:
    if (to_strategy is None) == (split is None):
        raise InvalidRequestError("give exactly one of to_strategy / to_layout")
    if split is not None:
        from ckptd.convert import derive_strategy

        if src is None:
            raise InvalidRequestError("to_layout needs a source strategy file", hint="use to_strategy")
        return derive_strategy(src, split.tp, split.dp, split.pp)
    return None if to_strategy == "none" else _load_strategy(store, to_strategy)


def _load_strategy(store: PosixStorage, path: str) -> Strategy:
    """A strategy file below the root is read only through the confined store (a FIFO there must
    not block the job thread, a symlink must not be followed); one outside it (``ckptd convert
    --run --to-strategy``: the operator's own file; the API refuses those) by name."""
    if runlayout.relative_parts(store.root, path) is None:
        return load_strategy(path)
    return parse_strategy_bytes(store.read(path, MAX_STRATEGY_BYTES), path)


def _confined_sources(stack: contextlib.ExitStack, store: PosixStorage, files: dict) -> dict:
    """The step's source files opened through the confined store, held open by ``stack`` for the
    whole conversion: the readers get names of the descriptors (a shard swapped for a FIFO or
    symlink since it was verified is refused here, never opened by name)."""
    def one(path: str) -> str:
        return stack.enter_context(store.opened(path))
    return {rank: one(f) if isinstance(f, str) else [one(p) for p in f] for rank, f in files.items()}


def convert_step(
    sessions: sessionmaker[Session],
    store: PosixStorage,
    run_name: str,
    step: int,
    *,
    to_strategy: str | None = None,
    split: ParallelSplit | None = None,
    out_dir: str | None = None,
    key: bytes | None = None,
    out_key: bytes | None = None,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    node: str | None = None,
) -> dict[str, Any]:
    """Convert ``step`` of ``run_name`` and catalogue the copy (see the module docstring). Run by a
    :class:`ckptd.service.jobs.JobRunner` job, the conversion is tied to that job; otherwise
    (``ckptd convert --run``) it records a job of its own, owned by this process on ``node``."""
    from ckptd.convert import convert, plan_conversion
    from ckptd.convert.execute import check_strategy_slot, read_inventory

    with sessions.begin() as s:
        ckpt, files, strat_row = check_source(s, run_name, step)
        # an iteration's tp/dp/pp split is its metadata.json's, not a strategy file's
        iteration = runlayout.by_name(repo.run_layout(s, ckpt)).iterations
        if strat_row is None and not iteration:
            raise InvalidRequestError(f"step {step} has no strategy file in the catalog", hint="convert with --src-strategy")
        src_id = ckpt.id
        src_path, src_hash, src_content = (strat_row.path, strat_row.content_hash, strat_row.content) if strat_row \
            else (None, None, None)
        ckpt.lease_until = datetime.now(timezone.utc) + CONVERT_LEASE
        meta = (ckpt.run_id, ckpt.prefix, ckpt.epoch, ckpt.step, ckpt.global_step)
    own_job: int | None = None  # the job this call records when no JobRunner job runs it (ckptd convert --run)
    heartbeat = jobs.Heartbeat(sessions)
    stack = contextlib.ExitStack()  # the confined source descriptors, held until the copy is written
    try:
        if iteration:  # a verified Checkpoint 2.0 iteration: its files per rank and layout from metadata.json
            files, src_strategy = iteration_source(os.path.dirname(next(iter(files.values()))), store)
            src_hash = src_strategy.content_hash() if src_strategy is not None else "none"
        else:  # the strategy the step was saved with, as catalogued (the file may have been overwritten since)
            src_strategy = parse_strategy_bytes(src_content, src_path) if src_content is not None \
                else _load_strategy(store, src_path)
        target = resolve_target(src_strategy, to_strategy, split, store)
        target_hash = target.content_hash() if target is not None else "none"
        out = out_dir or os.path.join(store.root, run_name, "converted", f"{meta[3]}-{target_hash.split(':')[-1][:12]}")
        node = node or repo.LOCAL.node
        with sessions.begin() as s:
            reused = _intact_copy(s, store, src_id, target_hash, out)
            if reused is not None:  # converting the same step into the same layout again: it is done
                return reused
            blocked = converted.blocking_copy(s, store, meta, target_hash, node)  # a lost copy is replaced, a whole one kept
        if blocked is not None:
            raise InvalidRequestError(blocked, hint="a copy's files may be deleted with the step (ckptd gc) or by hand")
        below_root = runlayout.relative_parts(store.root, out) is not None
        if below_root:  # refused early (nothing created) when a component is a symlink
            store.check_dir(out)
        sources = _confined_sources(stack, store, files)
        plan = plan_conversion(read_inventory(sources, key), src_strategy, target, subset=iteration)
        # the whole copy is written through this descriptor (ckptd.service.converted)
        out_handle = stack.enter_context(converted.open_output(store, out))
        strategy_path = runlayout.converted_strategy_path(out) if target is not None else None
        strategy_bytes = encode_strategy(target, "proto") if target is not None else None  # strategy.ckpt: protobuf
        strategy_file = (os.path.basename(strategy_path), strategy_bytes) if target is not None else None
        if strategy_file is not None:  # refused before a job row exists (convert checks again before writing)
            check_strategy_slot(out_handle, *strategy_file)
        with sessions.begin() as s:
            row = ConversionJob(run_id=meta[0], source_checkpoint_id=src_id, source_strategy_hash=src_hash,
                                target_strategy_hash=target_hash, out_dir=out, state="running")
            s.add(row)
            s.flush()
            conv_id = row.id
            job_id = jobs.current_job()
            if job_id is None:
                params = {"run": run_name, "step": step, "to_strategy": to_strategy,
                          "to_layout": str(split) if split is not None else None, "out_dir": out}
                job_id = own_job = jobs.record_job(s, "convert", meta[0], params, jobs.process_owner(node),
                                                 state="running").id
            jobs.link_conversion(s, job_id, conv_id)  # with the row: never a conversion without its owner
        if own_job is not None:
            heartbeat.add(own_job)
        report = None
        try:
            report = convert(None, src_strategy, target, out, plan=plan, key=key, out_key=out_key,
                             workers=workers, progress=progress, out_handle=out_handle, strategy_file=strategy_file)
            if below_root and not store.same_dir(out, out_handle.fd):
                raise ConfinementError("the output directory was moved or replaced during the conversion; "
                                               "the copy is not catalogued", path=out,
                                               hint="something else writes there: find out what before converting again")
            derived = converted.register(sessions, store, meta, src_id, target, target_hash,
                                      (strategy_path, strategy_bytes) if target is not None else None,
                                      converted.written_files(report), report.out_format, report.encrypted, node)
        except BaseException as exc:
            if report is not None:  # written but not catalogued: nothing that looks like a finished copy stays
                converted.discard(out_handle, report)
            error = str(exc) if isinstance(exc, CkptdError) else exc.__class__.__name__
            with sessions.begin() as s:
                row = s.get(ConversionJob, conv_id)
                row.state, row.error = "failed", error
                if own_job is not None:
                    job = s.get(Job, own_job)
                    job.state, job.error = "failed", error
            raise
        with sessions.begin() as s:
            row = s.get(ConversionJob, conv_id)
            row.state, row.progress, row.output_checkpoint_id = "done", 1.0, derived
            doc = conversion_dict(row, s) | {"report": report.to_dict(), "reused": False}
            if own_job is not None:
                job = s.get(Job, own_job)
                job.state, job.done, job.total = "done", 1, 1
                job.result = json.dumps({k: doc[k] for k in ("id", "out_dir", "output_checkpoint_id")})
        return doc
    finally:
        stack.close()
        heartbeat.close()
        with sessions.begin() as s:
            src = s.get(Checkpoint, src_id)
            if src is not None:
                src.lease_until = None


def _intact_copy(s: Session, store: PosixStorage, src_id: int, target_hash: str, out: str) -> dict[str, Any] | None:
    """The finished conversion of this step into this layout at ``out``, if its files are still
    the ones catalogued (converted copies are not watched, so check size/mtime/inode here)."""
    copy = jobrows.verified_copy(s, src_id, target_hash)
    if copy is None:
        return None
    job = jobrows.finished_conversion(s, copy.id, out)
    if job is None:
        return None
    shards = jobrows.shard_stats(s, copy.id)
    if not shards or any(stat_of(store, p) != repo.FileStat(size, mtime, inode) for p, size, mtime, inode in shards):
        return None  # changed or gone: converting again will say what is in the way
    return conversion_dict(job, s) | {"reused": True}


def conversion_dict(row: ConversionJob, s: Session) -> dict[str, Any]:
    src = s.get(Checkpoint, row.source_checkpoint_id)
    return {
        "id": row.id,
        "state": row.state,
        "source_step": src.step if src else None,
        "source_strategy_hash": row.source_strategy_hash,
        "target_strategy_hash": row.target_strategy_hash,
        "out_dir": row.out_dir,
        "output_checkpoint_id": row.output_checkpoint_id,
        "error": row.error,
        "created_at": iso_time(row.created_at),
    }


def list_conversions(s: Session, run_name: str) -> list[dict[str, Any]]:
    run = get_run(s, run_name)
    rows = jobrows.conversions_of_run(s, run.id)
    return [conversion_dict(r, s) for r in rows]


# --- conversions left by a dead process ----------------------------------------------------------


def recover_conversions(sessions: sessionmaker[Session], store: PosixStorage, report: dict[str, Any], *,
                        now: datetime | None = None, sweep_earlier: bool = True) -> dict[str, Any]:
    """Fail the queued/running conversions whose job is no longer live (its process is gone:
    :func:`ckptd.service.jobs.recover_abandoned` failed it first) and remove their temp trees.

    A conversion without a job (written before conversions recorded one) is abandoned once it
    was not updated for ``jobs.LEGACY_ABANDON_AFTER``. The source's lease is cut back to at most
    a resume lease from now (a resume answer given meanwhile may rely on it; the conversion's own
    two hours are gone). ``sweep_earlier`` (once, at start): temp trees of conversions failed as
    abandoned before — maybe by another daemon that could not reach this node's disk — are
    removed once their process is certainly gone on this machine. Partial output (rank
    directories renamed in just before the kill) is never deleted: it is named on the row and in
    ``report["left"]``."""
    from ckptd.service.resume import RESUME_LEASE

    now = now or datetime.now(timezone.utc)
    cleanups: list[tuple[int | None, str, Callable[[str, int], bool]]] = []  # (row id, out_dir, which temp trees)
    with sessions.begin() as s:
        rows = jobrows.lock_active_conversions(s, jobs.ACTIVE)
        earlier = jobrows.abandoned_conversions(s) if sweep_earlier else []
        if not rows and not earlier:
            return report  # the usual case: nothing to judge, one query
        links = jobs.conversion_links(s)
        abandoned = []
        for row in rows:
            job = links.get(row.id)
            if job is not None:
                if job.state in jobs.ACTIVE:
                    continue
                owner = jobs.job_meta(job).get("owner")
                why = (job.error or "").removeprefix("abandoned: ") if job.state == "failed" else None
                why = why or f"its job {job.id} ended ({job.state}) without finishing it"
            else:
                owner = None
                why = jobs.owner_gone(None, row.updated_at, now)
                if why is None:
                    continue
            row.state, row.error = "failed", f"abandoned: {why}"
            abandoned.append(row)
            report["conversions"].append({"id": row.id, "why": why})
            cleanups.append((row.id, row.out_dir, _temp_of(owner)))
        live = [r for r in rows if r.state in jobs.ACTIVE]
        reading = {r.source_checkpoint_id for r in live}
        busy_dirs = {os.path.abspath(r.out_dir) for r in live}
        for row in abandoned:
            src = s.get(Checkpoint, row.source_checkpoint_id)
            if (src is not None and row.source_checkpoint_id not in reading and src.lease_until is not None
                    and as_utc(src.lease_until) > now + RESUME_LEASE):
                src.lease_until = now + RESUME_LEASE
        # abandoned earlier, maybe by a daemon elsewhere: this machine may hold the temp tree
        for conv_id, out in earlier:
            owner = jobs.job_meta(links[conv_id]).get("owner") if conv_id in links else None
            if owner and jobs.same_pid_space(owner) and jobs.owner_gone(owner, None, now) is not None:
                cleanups.append((None, out, _temp_of(owner)))
    for j in report["conversions"]:
        log.warning("conversion %s failed as abandoned: %s", j["id"], j["why"])
    notes: dict[int, str] = {}
    for conv_id, out, wanted in cleanups:
        if os.path.abspath(out) in busy_dirs:
            continue  # a live conversion writes there: its trees are not ours to judge by name
        removed, refused, partial = _remove_temp_trees(store, out, wanted)
        report["removed"] += removed
        if conv_id is not None:  # said once, when the conversion is failed; not at every start after
            report["refused"] += refused
        if conv_id is not None and partial:
            with sessions() as s:
                catalogued = {os.path.relpath(p, out).split(os.sep)[0] for p in jobrows.shard_paths_under(s, out)}
            partial = sorted(set(partial) - catalogued)
            if partial:
                notes[conv_id] = (f"partial output {partial} left in {out} (not catalogued; remove it before "
                                  "converting this step into this layout again)")
                report["left"].append(notes[conv_id])
    for r in report["removed"]:
        log.info("removed the temp tree of an abandoned conversion: %s", r)
    for r in report["refused"] + report["left"]:
        log.warning("%s", r)
    if notes:
        with sessions.begin() as s:
            for conv_id, note in notes.items():
                row = s.get(ConversionJob, conv_id)
                row.error = f"{row.error}; {note}"
    return report


def _temp_of(owner: dict[str, Any] | None) -> Callable[[str, int], bool]:
    """Which temp trees (by the host and pid in their names) belong to a conversion's dead process."""
    from ckptd.convert.execute import dead_here

    if owner:
        host, pid = owner.get("host"), owner.get("pid")
        return lambda h, p: h == host and p == pid
    return dead_here  # no owner recorded: this host's trees whose process is gone (as convert itself does)


def _remove_temp_trees(store: PosixStorage, out: str, wanted: Callable[[str, int], bool]) -> tuple[list[str], list[str], list[str]]:
    """Remove the temp trees ``wanted`` picks in ``out`` (the one cleaner,
    :func:`ckptd.convert.execute.sweep_temp_trees`, on a descriptor of ``out`` reached beneath
    the root without a symlink): (removed paths, refusals, rank directories present in ``out``)."""
    from ckptd.convert.execute import sweep_temp_trees

    # An OSError is a refusal with its reason, never a reason for the daemon not to start.
    try:
        out_dir = Dir(store.open_dir(out), out, owned=True)
    except FileNotFoundError:
        return [], [], []
    except (ConfinementError, OSError) as err:
        why = ("outside the checkpoint root or reached through a symlink" if isinstance(err, ConfinementError)
               else f"cannot open it ({err.strerror or err})")
        return [], [f"{out}: {why}; temp data of the abandoned conversion there was not removed"], []
    try:
        removed, refused = sweep_temp_trees(out_dir, wanted)
        names = out_dir.names()
    except OSError as err:
        return [], [f"{out}: cannot list it ({err.strerror or err}); temp data of the abandoned conversion there "
                    "was not removed"], []
    finally:
        out_dir.close()
    return ([os.path.join(out, n) for n in removed], [os.path.join(out, r) for r in refused],
            sorted(n for n in names if runlayout.parse_rank_dir(n) is not None))
