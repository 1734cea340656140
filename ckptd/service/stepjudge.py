"""Judging a step as a whole once its shards are verified — also when its files live on several nodes.

The checks themselves are :mod:`ckptd.service.stepcheck` (facts per shard, combined per step).
This module decides *when* and *where* they run and stores the verdict:

* every file of the step visible here (one node, or a shared filesystem): read them, combine,
  store — nothing else is written;
* some files on other nodes (node-local disks mounted at the same path): each node computes the
  facts of the files it sees and stores them on their shard rows (``shards.facts``, keyed by the
  verification they follow and the layout they were checked against); under the step's row lock
  it then reads everyone's facts and, once every shard has fresh facts, combines them. The row
  lock serializes the nodes, so whichever stores the last facts finds all of them and decides.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.catalog import repo, steprows
from ckptd.catalog.models import Checkpoint, Run, StrategyFile
from ckptd.errors import CkptdError
from ckptd.format.index_cache import IndexCache
from ckptd.format.strategy import MAX_STRATEGY_BYTES, Strategy, parse_strategy_bytes
from ckptd.service import iteration
from ckptd.service.stepcheck import ReplicaCheck, ShardFacts, ShardRef, StepVerdict, combine, replica_names, shard_facts
from ckptd.states import ShardState
from ckptd.storage import ConfinementError, PosixStorage

#: how a step's reason starts when its files verified but no layout could be checked
LAYOUT_UNCHECKED = "layout unchecked: "


@dataclass(frozen=True)
class _Row:
    """A step's shard as the checks read it (``steprows.SHARD_ROW_COLUMNS``, in that order)."""

    id: int
    rank: int
    path: str
    size: int
    mtime_ns: int
    inode: int
    state: str
    seq: int
    facts: str | None

    @property
    def file(self) -> tuple:
        return (self.id, self.rank, self.path, self.size, self.mtime_ns, self.inode)


@dataclass(frozen=True)
class FactsPlan:
    """What a step's shard facts are computed against: its layout binding and the sampled
    replica parameters (``stamp`` names both, so facts of another binding are never reused)."""

    strategy: Strategy | None
    names: tuple[str, ...]
    subset: bool
    stamp: str

    def encode(self, facts: ShardFacts, seq: int) -> str:
        """The ``shards.facts`` value: these facts, valid for verification ``seq`` of the shard."""
        return json.dumps({"stamp": self.stamp, "seq": seq, "facts": facts.encode()})


class StepJudge:
    def __init__(self, store: PosixStorage, sessions: sessionmaker[Session], key: bytes | None,
                 replicas: ReplicaCheck = ReplicaCheck(), index_cache: IndexCache | None = None) -> None:
        self.store, self.sessions, self.key, self.replicas, self.index_cache = store, sessions, key, replicas, index_cache
        self._strategies: dict[tuple[str, str], Strategy] = {}

    def strategy_for(self, row: StrategyFile | None) -> Strategy | None:
        found = self._read_strategy(row)
        return found if isinstance(found, Strategy) else None

    def _read_strategy(self, row: StrategyFile | None) -> Strategy | str | None:
        """The strategy a row catalogues, or why it cannot be read (None: no row)."""
        if row is None:
            return None
        if row.error:
            return row.error
        key = (row.path, row.content_hash)
        if key not in self._strategies:
            try:  # the content as catalogued: the file on disk may describe a newer layout by now
                # (a row without it: the file, read through the confined store — never a FIFO or symlink)
                content = row.content if row.content is not None else self.store.read(row.path, MAX_STRATEGY_BYTES)
                self._strategies[key] = parse_strategy_bytes(content, row.path)
            except CkptdError as err:
                return str(err)
            except OSError as err:
                return f"{row.path}: cannot read it: {err.strerror or err}"
        return self._strategies[key]

    def unchecked_layout(self, s: Session, ckpt: Checkpoint) -> str | None:
        """Why the step's shards cannot be checked against a layout although the run has a strategy
        (``layout unchecked: <why>``), or None: checked, or the run has no strategy at all (a pure
        data-parallel job writes none). The one rule for every way a strategy is unreadable (a
        damaged file, a per-rank file that spoils the merge, a symlinked ``strategy/``): the files
        verified, so the step stays restorable, and the reason says what was not proven
        (docs/ARCHITECTURE.md, "Layout checks")."""
        if ckpt.kind == "converted":
            return None  # ckptd wrote it, with the strategy it bound the copy to
        found = self._read_strategy(s.get(StrategyFile, ckpt.strategy_id) if ckpt.strategy_id else None)
        if isinstance(found, Strategy):
            return None
        run = s.get(Run, ckpt.run_id)
        why = found or (_unusable_strategy(s, run) if run is not None and run.path else None) or \
            (_refused_on_disk(self.store, run.path) if run is not None and run.path else None)
        return f"{LAYOUT_UNCHECKED}{why}" if why else None

    def facts_plan(self, s: Session, ckpt: Checkpoint) -> FactsPlan | None:
        """How the verifier computes a shard's facts in its own pass over the file (each byte read
        once: the step check then reuses them), read in the caller's session (the verifier's claim
        transaction: no round trips of its own on the hot path); None for steps judged otherwise
        (Checkpoint 2.0)."""
        return None if _layout(s, ckpt).iterations else self._plan(s, ckpt)

    def _plan(self, s: Session, ckpt: Checkpoint) -> FactsPlan:
        strategy = self.strategy_for(s.get(StrategyFile, ckpt.strategy_id) if ckpt.strategy_id else None)
        names = replica_names(strategy, self.replicas.mode, self.replicas.sample,
                              f"{ckpt.run_id}:{ckpt.step}:")
        return FactsPlan(strategy, names, _subset(s, ckpt), _stamp((ckpt.strategy_id, ckpt.expected_ranks), names))

    # --- when ------------------------------------------------------------------------------------

    def ready(self, ckpt_id: int) -> bool:
        """Step checks not run yet and something to do: every file verified and every expected
        rank present (a run allowing subset saves: with a strategy, whatever is present); when
        some files are on other nodes, as soon as the ones visible here are verified (their facts
        are this node's contribution).

        Asked after every verified batch, so it reads three columns and stats as few files as the
        answer needs: during a burst a visible unverified file is found at the first look (it was
        a stat of every file of the step, and the step's stored facts, per batch)."""
        with self.sessions() as s:
            ckpt = s.get(Checkpoint, ckpt_id)
            if ckpt is None or ckpt.step_checks_ok is not None or ckpt.expected_ranks is None:
                return False
            rows = steprows.shard_states(s, ckpt_id)
            if not rows:
                return False
            verified = [r for r in rows if r.state == ShardState.VERIFIED.value]
            if len(verified) < len(rows):
                # ready only if every unverified file is another node's (not visible here) and
                # this node verified at least one
                if any(self.store.exists(r.path) for r in rows if r.state != ShardState.VERIFIED.value):
                    return False
                return any(self.store.exists(r.path) for r in verified)
            whole = (ckpt.strategy_id is not None and _subset(s, ckpt)) or \
                len({r.rank for r in rows}) >= ckpt.expected_ranks or len(rows) >= ckpt.expected_ranks
            if whole:
                return any(self.store.exists(r.path) for r in rows)
            # ranks still missing: judged only as this node's part of a step spread over nodes
            exists = [self.store.exists(r.path) for r in rows]
            return any(exists) and not all(exists)

    # --- what ------------------------------------------------------------------------------------

    def check(self, ckpt_id: int, *, unjudged_only: bool = False) -> list[str]:
        """Run the step-level checks now and store the verdict (also used for re-verification).
        Returns the problems found, or [] while other nodes' facts are still missing.
        ``unjudged_only``: store nothing if the step got a verdict meanwhile (several daemons
        on one root may find the same step ready; one verdict is enough)."""
        with self.sessions() as s:
            ckpt = s.get(Checkpoint, ckpt_id)
            if ckpt is None:
                return []
            if _layout(s, ckpt).iterations:
                return self._check_iteration(ckpt_id, unjudged_only)
            rows = self._rows(s, ckpt_id)
            expected = ckpt.expected_ranks
            binding = (ckpt.strategy_id, ckpt.expected_ranks)
            plan = self._plan(s, ckpt)
            unchecked = self.unchecked_layout(s, ckpt) if plan.strategy is None else None
        strategy, names, subset, stamp = plan.strategy, plan.names, plan.subset, plan.stamp
        t0 = time.perf_counter()
        refs = [ShardRef(r.rank, r.path) for r in rows]
        visible = {r.id for r in rows if self.store.exists(r.path)}
        computed = {r.id: self._facts(r, strategy, names, subset) for r in rows
                    if r.id in visible and _fresh(r, stamp) is None}
        with self.sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)
            now_rows = self._rows(s, ckpt_id)
            if unjudged_only and ckpt.step_checks_ok is not None:
                return []  # another daemon (or thread) judged it while we read
            if [r.file for r in now_rows] != [r.file for r in rows] or (ckpt.strategy_id, ckpt.expected_ranks) != binding:
                # shards changed, or the step was re-bound to a new layout, while we checked: the
                # verdict would be stale; whoever changed it asked for a new check
                return []
            if any(r.state == ShardState.COMPLETE.value for r in now_rows if r.id in visible):
                # files registered after this check was found due (a subset-save step is due with
                # whatever is verified) are still being verified: their verification asks again,
                # and a verdict now would be stored before their content steps are known
                return []
            distributed = len(visible) < len(rows)
            facts: dict[int, ShardFacts] = {}
            for r in now_rows:
                verified = r.state == ShardState.VERIFIED.value
                if r.id in computed and (verified or not distributed):
                    facts[r.rank] = computed[r.id]
                    if distributed:  # shared with the nodes that cannot read this file
                        steprows.share_facts(s, r.id, r.seq, plan.encode(computed[r.id], r.seq))
                elif verified and (known := _fresh(r, stamp)) is not None:
                    facts[r.rank] = known  # recorded by the verification that read the file (or by its node)
            if distributed and len(facts) < len(now_rows):
                return []  # the nodes holding the other files add theirs; the last one decides
            verdict = combine(refs, facts, expected, strategy, names, subset=subset)
            self._store(s, ckpt, verdict, verdict.problems, unchecked, time.perf_counter() - t0)
        return verdict.problems

    def _check_iteration(self, ckpt_id: int, unjudged_only: bool) -> list[str]:
        """A Checkpoint 2.0 iteration: judged from its own records (:mod:`ckptd.service.iteration`).
        MindFormers requires shared storage for these saves, so every file is visible here."""
        with self.sessions() as s:
            ckpt = s.get(Checkpoint, ckpt_id)
            rows = self._rows(s, ckpt_id)
            step = ckpt.step
        if not rows or any(r.state == ShardState.COMPLETE.value for r in rows):
            return []  # still being verified: the last verification asks again
        if not all(self.store.exists(r.path) for r in rows):
            return []  # a file vanished since it was judged ready: its deletion asks again
        t0 = time.perf_counter()
        verdict = iteration.judge(self.store, step, {r.rank: r.path for r in rows})
        with self.sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)
            if unjudged_only and ckpt.step_checks_ok is not None:
                return []
            if self._rows(s, ckpt_id) != rows:
                return []  # changed or re-verified meanwhile: whoever changed it asks again
            reason = verdict.reason()
            if verdict.incomplete:
                # not judged: the files may still arrive (async saves write the JSON records first);
                # the step is short of files until then, so it reads as incomplete with this reason
                ckpt.step_checks_ok, ckpt.reason = None, reason
                ckpt.expected_ranks = max(verdict.required, len(rows) + len(verdict.missing))
            else:
                ckpt.step_checks_ok, ckpt.reason = not verdict.problems, reason
                ckpt.expected_ranks = verdict.required
                if not verdict.problems:
                    ckpt.global_step = step  # the iteration *is* the global step (resumed offset included)
            ckpt.health_reason = verdict.health_reason
            repo.add_event(s, ckpt.id, None, "step", "ok" if ckpt.step_checks_ok else "failed", reason,
                           time.perf_counter() - t0)
            repo.recompute_step_state(s, ckpt)
        return verdict.problems + [f"missing {name}" for name in verdict.missing]

    def _facts(self, row: _Row, strategy: Strategy | None, names: tuple[str, ...], subset: bool) -> ShardFacts:
        return shard_facts(self.store, ShardRef(row.rank, row.path), strategy, self.key, names,
                           subset=subset, index_cache=self.index_cache)

    @staticmethod
    def _rows(s: Session, ckpt_id: int) -> list[_Row]:
        return [_Row(*r) for r in steprows.live_shard_rows(s, ckpt_id)]

    @staticmethod
    def _store(s: Session, ckpt: Checkpoint, verdict: StepVerdict, problems: list[str], unchecked: str | None,
               seconds: float) -> None:
        steps = steprows.global_steps(s, ckpt.id)
        ckpt.step_checks_ok = not problems
        ckpt.reason = "; ".join(problems + ([unchecked] if unchecked else [])) or None  # unchecked: said, not failed
        if verdict.incomplete:
            ckpt.reason = f"ranks {list(verdict.missing)} have no file and the others do not cover the layout: {ckpt.reason}"
        ckpt.load_plan = (json.dumps({str(r): list(src) for r, src in verdict.load_plan.items()})
                          if not problems and verdict.load_plan else None)
        if not problems and len(steps) == 1:
            ckpt.global_step = steps.pop()
        repo.add_event(s, ckpt.id, None, "step", "ok" if not problems else "failed", ckpt.reason, seconds)
        repo.recompute_step_state(s, ckpt)


def _stamp(binding: tuple, names: tuple[str, ...]) -> str:
    """What facts were computed against: the step's layout binding and the sampled parameters
    (a node with other replica settings would sample others, so its facts are not reused)."""
    return json.dumps([list(binding), list(names)])


def _fresh(row: _Row, stamp: str) -> ShardFacts | None:
    if not row.facts:
        return None
    try:
        doc = json.loads(row.facts)
        if doc.get("stamp") != stamp or doc.get("seq") != row.seq:
            return None
        return ShardFacts.decode(doc["facts"])
    except (ValueError, KeyError, TypeError):
        return None


def _layout(s: Session, ckpt: Checkpoint) -> runlayout.RunLayout:
    """The layout the step is judged by (a converted copy is ckptd's own, native: none of the run's)."""
    return runlayout.by_name(repo.run_layout(s, ckpt) if ckpt.kind != "converted" else None)


def _subset(s: Session, ckpt: Checkpoint) -> bool:
    return _layout(s, ckpt).allows_subset


def _unusable_strategy(s: Session, run: Run) -> str | None:
    """Why the run's own strategy is unusable, when its newest catalogued content is an error: a
    strategy file that does not parse, or per-rank files that do not merge (their merge row says why)."""
    root = os.path.dirname(run.path)
    for path, error in steprows.strategy_errors(s, run.id):
        name = runlayout.classify(root, path)
        if path == runlayout.rank_strategies_dir(run.path) or (
                isinstance(name, runlayout.StrategyName) and name.run == run.name and name.rank is None):
            return error  # the newest of the run's own: None when it is readable
    return None


def _refused_on_disk(store: PosixStorage, run_path: str) -> str | None:
    """A strategy ckptd never reads because of what it is on disk (a symlinked ``strategy/``, a
    strategy file that is a symlink or FIFO): ingest refuses those without a catalog row."""
    directory = runlayout.rank_strategies_dir(run_path)
    try:
        store.check_dir(directory)
    except ConfinementError as err:
        return f"{directory}: {err.message}: strategy files are never read through it"
    except OSError:
        return None
    for base in (run_path, directory):
        try:
            odd = sorted(path for e in store.entries(base) if e.kind not in ("file", "dir", "gone")
                         and isinstance(runlayout.classify(store.root, path := os.path.join(base, e.name)),
                                        runlayout.StrategyName))
        except OSError:
            continue
        if odd:
            return f"{odd[0]} is not a regular file: never read"
    return None
