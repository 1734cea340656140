"""Ingest: reconcile the catalog with what is on disk under the checkpoint root.

The full rescan is the source of truth (files that appeared, changed or vanished while nobody
watched are all found); file events only make it fast by examining single paths early. Both
paths end in the same idempotent ``_ingest_checkpoint`` / ``_ingest_strategy``.

Layout changes (rule in :mod:`ckptd.states`) are followed from both ends, so the order in which
a strategy file and the re-saved shards are seen does not matter: a checkpoint's ingest checks
its own step, a strategy file's ingest checks every step bound to an older content of that file.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Callable

from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.catalog import layout_history, reads, repo, scanrows, verdicts
from ckptd.catalog.nodes import NodeView
from ckptd.catalog.models import Run, StrategyFile
from ckptd.errors import CkptdError
from ckptd.format.index_cache import IndexCache
from ckptd.format.strategy import MAX_STRATEGY_BYTES, encode_strategy, parse_strategy_bytes
from ckptd.service import iteration, rank_strategies, replaced, runhints, shardopen
from ckptd.service.verifier import ShardRules
from ckptd.states import RESAVABLE_KINDS, ShardState, StepState, awaits_verification
from ckptd.storage import ConfinementError

log = logging.getLogger("ckptd.ingest")
_BATCH = 512  # shard paths a rescan examines per batch


@dataclass
class ScanReport:
    shards_seen: int = 0
    shards_new: int = 0
    shards_deleted: int = 0
    unsettled: list[str] = field(default_factory=list)


class Ingestor:
    def __init__(
        self,
        rules: ShardRules,
        sessions: sessionmaker[Session],
        submit: Callable[..., None],
        submit_step: Callable[[int], None],
        nodes: NodeView,
        *,
        settle_seconds: float = 2.0,
        world_size: int | None = None,
        index_cache: IndexCache | None = None,
    ) -> None:
        self.store = rules.store
        self.root = rules.store.root
        self.sessions = sessions
        self.submit = submit  # shards need verification (``Verifier.submit``)
        self.submit_step = submit_step  # a step may be ready for its step-level checks
        self.key, self.stamp = rules.key, rules.stamp
        self.settle_seconds = settle_seconds  # a writable file must be unchanged this long
        self.world_size = world_size  # the configured world size: used when no strategy file says it
        self.index_cache = index_cache  # shared with the verifier: its opens reuse ingest's parse
        self._ignored: dict[str, str] = {}  # path -> why, so each reason is logged once
        # only the node that sees a file judges it (docs/ARCHITECTURE.md, Nodes)
        self.nodes = nodes

    def note_ignored(self, path: str, why: str) -> None:
        """A path that looks like ours but is not taken: say why, once per path and reason."""
        if self._ignored.get(path) != why:
            if len(self._ignored) > 10_000:
                self._ignored.clear()
            self._ignored[path] = why
            log.warning("ignoring %r: %s", path, why)

    # --- entry points --------------------------------------------------------------------------

    def rescan(self, should_stop: Callable[[], bool] = lambda: False) -> ScanReport:
        """Reconcile everything under the root. Files whose size/mtime/inode match their catalog
        row are not opened again (one bulk select per rescan), so a rescan of an unchanged tree
        costs a stat per file; unchanged shards still waiting for verification are re-queued."""
        report = ScanReport()
        seen: set[str] = set()
        todo: list[str] = []
        requeue: list[int] = []
        claim: list[str] = []  # files we see whose rows have no node, or an unreachable one
        owner = self.nodes.owner()
        known = self._known_stats()
        try:
            runs = sorted(e.name for e in self.store.entries(self.root) if e.kind == "dir" and not e.name.startswith("."))
        except FileNotFoundError:
            runs = []
        for run in [r for r in runs if runlayout.unusable_name(r)]:
            self.note_ignored(os.path.join(self.root, run), f"run directory skipped: {runlayout.unusable_name(run)}")
            runs.remove(run)
        for run in runs:
            run_path = os.path.join(self.root, run)
            self.examine_many(self._strategy_candidates(run_path))  # per-rank strategy files: one merge
            listed = runlayout.shard_dirs(run_path)
            for rank, link in listed.linked.items():
                self.note_ignored(link, "a rank directory that is a symlink: never followed, nothing in it is catalogued")
                replaced.note_linked_rank_dir(self.sessions, run, rank, link)
            for path, why in listed.refused.items():
                self.note_ignored(path, f"directory skipped: {why}")
            for shard_dir in listed.shard_dirs:
                for entry in self.store.entries(shard_dir):
                    if should_stop():
                        return report  # the catalog is unchanged by what was not examined
                    path = os.path.join(shard_dir, entry.name)
                    why = listed.layout.unusable_name(entry.name)
                    if why is not None and not runlayout.is_in_flight(entry.name):
                        self.note_ignored(path, why)
                        continue
                    if isinstance(runlayout.classify(self.root, path), runlayout.ShardName):
                        report.shards_seen += 1
                        seen.add(path)
                        row = known.get(path)
                        if row is not None and row[5] != owner.node and owner.may_take(row[5]):
                            claim.append(path)
                        state = self._unchanged(path, known)
                        if state is None:
                            todo.append(path)
                        elif state[1] == ShardState.COMPLETE.value:
                            requeue.append(state[0])  # parsed at ingest, not verified yet (e.g. a crash)
                        if len(todo) >= _BATCH:
                            self._tally(self.examine_many(todo), report)
                            todo = []
        self._tally(self.examine_many(todo), report)
        if requeue:
            self.submit(requeue, if_unverified=True)  # the verifier ignores ids it already has queued or in hand
        for ckpt_id in self._steps_awaiting_checks(runs):
            self.submit_step(ckpt_id)  # shards all verified, step checks never ran (e.g. a crash)
        self._claim_seen(claim, owner)
        # catalogued files a rescan did not list but whose name still resolves: a rank directory became a symlink
        replaced.mark_replaced(self.sessions, self.store, [p for p in known if p not in seen and self.store.exists(p)], owner)
        report.shards_deleted = self._reconcile_deleted(seen, owner)
        return report

    def _steps_awaiting_checks(self, runs: list[str]) -> list[int]:
        if not runs:
            return []
        with self.sessions() as s:
            return scanrows.steps_awaiting_checks(s, runs)

    @staticmethod
    def _tally(outcomes: dict[str, str], report: ScanReport) -> None:
        for path, outcome in outcomes.items():
            if outcome == "new":
                report.shards_new += 1
            elif outcome == "unsettled":
                report.unsettled.append(path)

    def _known_stats(self) -> dict[str, tuple[int, int, int, int, str, str | None]]:
        """(size, mtime_ns, inode, id, state, node) of every catalogued shard under the root that
        needs no new examination while its file is unchanged: settled (verified/corrupt/
        superseded) ones, and complete ones (they parsed at ingest and only wait for verification)."""
        prefix = self.root.rstrip(os.sep) + os.sep
        with self.sessions() as s:
            rows = scanrows.shard_stats_below(s, prefix, (ShardState.VERIFIED.value, ShardState.CORRUPT.value,
                                                          ShardState.COMPLETE.value, ShardState.SUPERSEDED.value))
        return {p: (size, mtime, inode, sid, self._state_now(state, stamp, code), node)
                for p, size, mtime, inode, sid, state, node, stamp, code in rows}

    def _state_now(self, state: str, stamp: str | None, error_code: str | None) -> str:
        """A verdict given under another configuration is not trusted: such a shard is treated
        like one waiting for verification, so the rescan re-queues it."""
        return ShardState.COMPLETE.value if awaits_verification(state, stamp, error_code, self.stamp) else state

    def _unchanged(self, path: str, known: dict[str, tuple]) -> tuple[int, str] | None:
        """(id, state) of the catalogued row if the file is the one catalogued, else None."""
        row = known.get(path)
        if row is None:
            return None
        st = self.store.stat(path)
        if st is None:
            return None
        return (row[3], row[4]) if row[:3] == (st.st_size, st.st_mtime_ns, st.st_ino) else None

    def examine(self, path: str) -> str:
        """Bring the catalog in line with one path. Returns new|changed|same|unsettled|deleted|ignored."""
        return self.examine_many([path]).get(path, "ignored")

    def examine_many(self, paths: list[str]) -> dict[str, str]:
        """``examine`` for many paths at once: shards of one checkpoint are registered in one
        transaction (a 512-rank save is one burst of renames), so a step's ingest costs a
        handful of statements instead of a dozen per shard."""
        outcomes: dict[str, str] = {}
        shards: dict[str, runlayout.ShardName] = {}
        rank_strategies: dict[str, list[str]] = {}  # run -> its per-rank strategy files in this batch
        for path in dict.fromkeys(paths):  # de-duplicated, in order
            kind = runlayout.classify(self.root, path)
            if isinstance(kind, runlayout.ShardName):
                shards[path] = kind
            elif isinstance(kind, runlayout.StrategyName) and kind.rank is not None:
                rank_strategies.setdefault(kind.run, []).append(path)
            elif isinstance(kind, runlayout.StrategyName):
                outcomes[path] = self._ingest_strategy(kind.run, path)
            elif isinstance(kind, runlayout.HealthName):
                outcomes[path] = self._ingest_health(kind.run)
            elif isinstance(kind, runlayout.MetaName):
                outcomes[path] = "ignored"  # MindFormers' own hint: lags and can lie (ckptd.service.runhints)
            elif path.endswith(runlayout.SIDECAR_SUFFIX):
                outcomes[path] = self._sidecar(path[: -len(runlayout.SIDECAR_SUFFIX)])
            else:
                outcomes[path] = "ignored"
        for run_name, run_paths in rank_strategies.items():
            outcome = self._ingest_rank_strategies(run_name)
            outcomes.update(dict.fromkeys(run_paths, outcome))
        if shards:
            outcomes.update(self._ingest_shards(shards))
        return outcomes

    def _sidecar(self, shard_path: str) -> str:
        """A commit hint appeared or changed: (re-)check its shard against it."""
        if not isinstance(runlayout.classify(self.root, shard_path), runlayout.ShardName):
            return "ignored"
        outcome = self.examine(shard_path)
        with self.sessions() as s:
            shard_id = scanrows.shard_id_at(s, shard_path)
        if shard_id is not None and outcome == "same":
            self.submit([shard_id])
        return outcome

    # --- shards --------------------------------------------------------------------------------

    def _ingest_shards(self, shards: dict[str, runlayout.ShardName]) -> dict[str, str]:
        outcomes: dict[str, str] = {}
        ready: dict[tuple, list[tuple[runlayout.ShardName, repo.ShardFile, CkptdError | None]]] = {}
        vanished, swapped = [], []
        for path, name in shards.items():
            st = self.store.stat(path)
            if st is None:
                vanished.append(path)
                continue
            if not stat.S_ISREG(st.st_mode):
                self._ignore_unreadable(path, outcomes, swapped)
                continue
            # MindSpore renames into place then chmods 0400; a writable file may still be growing
            # (an operator's cp), so it must be unchanged for settle_seconds first.
            if st.st_mode & 0o222 and time.time() - st.st_mtime < self.settle_seconds and not self.store.exists(
                runlayout.sidecar_for(path)  # the trainer's "done" sidecar says the write is complete
            ):
                outcomes[path] = "unsettled"
                continue
            fstat = repo.FileStat(st.st_size, st.st_mtime_ns, st.st_ino)
            key = (name.run, name.prefix, name.epoch, name.step, name.kind, name.layout, name.incarnation)
            # opened through the confined store: a symlinked directory on the way, or a FIFO
            # swapped in since the lstat, is refused, not followed or waited on
            problem = shardopen.parse_error(self.store, path, self.key, self.index_cache)
            if isinstance(problem, ConfinementError):
                self._ignore_unreadable(path, outcomes, swapped)
                continue
            ready.setdefault(key, []).append((name, repo.ShardFile(name.rank, path, fstat, name.format), problem))
        if vanished:
            outcomes.update(self._vanished_many(vanished))
        for path in replaced.mark_replaced(self.sessions, self.store, swapped, self.nodes.owner()):
            outcomes[path] = "changed"  # a catalogued shard swapped for something never read
        for key in sorted(ready):  # one transaction per checkpoint: it locks that one row only
            outcomes.update(self._ingest_checkpoint(key, ready[key]))
        # after the registrations: a step's new files reset its reason
        replaced.note_unread(self.sessions, self.store, {p: shards[p] for p in swapped if outcomes[p] == "ignored"})
        return outcomes

    def _ignore_unreadable(self, path: str, outcomes: dict[str, str], swapped: list[str]) -> None:
        outcomes[path] = "ignored"  # symlinks (file or directory) are never followed out of the root
        self.note_ignored(path, "named like a checkpoint shard but not a regular file inside the root "
                                "(symlink, FIFO, device or directory): not catalogued")
        swapped.append(path)

    def _ingest_checkpoint(
        self, key: tuple, files: list[tuple[runlayout.ShardName, repo.ShardFile, CkptdError | None]]
    ) -> dict[str, str]:
        run_name, prefix, epoch, step, kind, layout_name, incarnation = key
        layout = runlayout.by_name(layout_name)
        with self.sessions.begin() as s:
            run = repo.get_or_create_run(s, run_name, os.path.join(self.root, run_name))
            if not run.path:  # created by an early health report, before any file was seen
                run.path = os.path.join(self.root, run_name)
            if (recorded := runlayout.run_layout_after(run.layout, layout_name)) != run.layout:
                run.layout = recorded  # a run holds one layout; a MindFormers tree is never taken for native
            strategy = rank_strategies.current(s, self.store, run)
            expected = self._expected_ranks(run, strategy)
            ckpt = repo.get_or_create_checkpoint(s, run, prefix, epoch, step, kind, expected)
            ckpt = repo.lock_checkpoint(s, ckpt.id)  # register_shards then locks its history before shards
            if ckpt.incarnation is None and incarnation is not None:
                ckpt.incarnation = incarnation
            if layout.health_records and ckpt.health_reason is None and ckpt.state == StepState.INCOMPLETE.value:
                runhints.apply_health(self.store, run, [ckpt])  # rank 0 writes the record before the save itself
            if strategy is not None and ckpt.strategy_id is None:
                # a strategy file is authoritative over the rank-directory count
                ckpt.strategy_id, ckpt.expected_ranks = strategy.id, strategy.world_size
            elif ckpt.expected_ranks is None and expected is not None:
                ckpt.expected_ranks = expected
            layout_now = (strategy.world_size, layout_history.appeared_ns(strategy.mtime_ns, strategy.seen_at)) if strategy else None
            registered = repo.register_shards(s, ckpt, [f for _, f, _ in files], layout_now, self.nodes.owner())
            if layout.iterations:  # an iteration's file names say how many files it has
                present = {os.path.basename(p) for p in repo.shard_paths(s, ckpt.id)}
                need = iteration.required_by_names(present)
                ckpt.expected_ranks = max(ckpt.expected_ranks or 0, len(need))
                missing = sorted(need - present)
            superseded: frozenset = frozenset()
            if strategy is not None and ckpt.strategy_id not in (None, strategy.id):
                resave = layout_history.follow_layout_change(s, ckpt)  # None unless the step was re-saved under a newer layout
                superseded = resave.superseded if resave is not None else superseded
            back = {reg.moved_from for reg in registered if reg.moved_from is not None}
            if back:  # superseded shards rewritten: they are the step's again
                layout_history.drop_empty_history(s, ckpt, back)
            to_verify: list[int] = []
            for reg, (_, f, parse_error) in zip(registered, files, strict=True):
                if reg.changed and parse_error is not None:
                    verdicts.record_verification(
                        s, reg.shard_id, f.stat, state=ShardState.CORRUPT, ckpt_id=ckpt.id,
                        values={"error_code": parse_error.code, "error": str(parse_error)}, detail=str(parse_error), seconds=0.0,
                    )
                elif reg.state == ShardState.COMPLETE.value and reg.shard_id not in superseded:
                    to_verify.append(reg.shard_id)  # also re-queues shards a crashed daemon left unverified
            if any(reg.changed for reg in registered):
                ckpt.step_checks_ok, ckpt.reason = None, None
                if layout.iterations and missing:  # what an operator asks first about a partial save
                    ckpt.reason = iteration.describe_missing(missing, iteration.in_flight(self.store, os.path.dirname(files[0][1].path)))
            step_state = repo.recompute_step_state(s, ckpt)
            ckpt_id = ckpt.id
        if to_verify:
            self.submit(to_verify, if_unverified=True)
        elif step_state == StepState.PENDING:
            self.submit_step(ckpt_id)  # every shard verified but the step checks never ran (e.g. a crash)
        return {f.path: "new" if reg.changed else "same" for reg, (_, f, _) in zip(registered, files, strict=True)}

    def _follow_layout_changes(self, run_id: int) -> None:
        """After a strategy file was seen: steps bound to an older content of a strategy file with
        a shard written after the file's current content appeared were re-saved under it. Finds
        those whose shards were catalogued before the new strategy (file events in either order,
        a crash between the two); a run whose strategy files never changed costs one query."""
        candidates: set[int] = set()
        with self.sessions() as s:
            for at_path in layout_history.strategy_rows(s, run_id).values():
                now, older = at_path[0], [r.id for r in at_path[1:] if r.content_hash != at_path[0].content_hash]
                if not now.valid or not older:
                    continue
                candidates.update(scanrows.resaved_candidates(s, run_id, older, now.appeared_ns, now.world_size,
                                                              RESAVABLE_KINDS))
        for ckpt_id in sorted(candidates):  # one transaction per step: it locks that one row (and its history)
            with self.sessions.begin() as s:
                ckpt = repo.lock_checkpoint(s, ckpt_id)
                if layout_history.follow_layout_change(s, ckpt) is None:
                    continue
                state = repo.recompute_step_state(s, ckpt)
            if state == StepState.PENDING:
                self.submit_step(ckpt_id)  # every shard of the new layout verified: check the step under it

    def _vanished_many(self, paths: list[str]) -> dict[str, str]:
        """Mark catalogued shards whose files are gone as deleted (rows are kept for history);
        one transaction per checkpoint — a keep-last-N rotation removes a whole step at once."""
        out = {p: "ignored" for p in paths}
        by_ckpt: dict[int, list[str]] = {}
        with self.sessions() as s:
            for i in range(0, len(paths), _BATCH):
                for path, ckpt_id in scanrows.checkpoints_of(s, paths[i : i + _BATCH]):
                    by_ckpt.setdefault(ckpt_id, []).append(path)
        owner = self.nodes.owner()
        for ckpt_id in sorted(by_ckpt):
            with self.sessions.begin() as s:
                ckpt = repo.lock_checkpoint(s, ckpt_id)  # lock order everywhere: checkpoint, then its shards
                gone = [sh for sh in scanrows.undeleted_shards_at(s, by_ckpt[ckpt_id])
                        if owner.may_judge_gone(sh.node)]  # not seeing another node's file proves nothing
                for shard in gone:
                    repo.mark_deleted(s, shard)
                    out[shard.path] = "deleted"
                if gone:
                    repo.recompute_step_state(s, ckpt)
        return out

    def _reconcile_deleted(self, seen: set[str], owner: repo.Owner) -> int:
        """This node's shards whose files are gone. Rows of other nodes are judged here only when
        their node is unreachable and shares this root (``Owner.may_judge_gone``): on a node-local
        disk their files are simply not ours to see (they keep their last verdict)."""
        prefix = self.root.rstrip(os.sep) + os.sep
        with self.sessions() as s:
            known = scanrows.judged_paths_below(s, prefix, owner)
        gone = [p for p in known if p not in seen and not self.store.exists(p)]
        return sum(outcome == "deleted" for outcome in self._vanished_many(gone).values())

    def _claim_seen(self, paths: list[str], owner: repo.Owner) -> None:
        """Files this node sees whose rows have no node (catalogued before migration 0006) or an
        unreachable one (a shared filesystem outlives its node) are this node's from now on."""
        for i in range(0, len(paths), _BATCH):
            with self.sessions.begin() as s:
                scanrows.claim_paths(s, paths[i : i + _BATCH], owner)

    # --- strategies ----------------------------------------------------------------------------

    def _strategy_candidates(self, run_path: str) -> list[str]:
        out = []
        for base in (run_path, os.path.join(run_path, "strategy")):
            if not self.store.is_dir(base):
                continue  # a strategy/ directory pointing elsewhere is never read
            try:
                out += [os.path.join(base, e.name) for e in self.store.entries(base) if e.kind == "file"]
            except FileNotFoundError:
                pass
        return sorted(out)

    def _ingest_strategy(self, run_name: str, path: str) -> str:
        try:  # never through a symlink, never a FIFO or device
            content, st = self.store.read_with_stat(path, MAX_STRATEGY_BYTES)
            mtime_ns = st.st_mtime_ns  # when this layout appeared, if it is new here
        except ConfinementError as err:
            self.note_ignored(path, err.message)
            return "ignored"
        except OSError:
            return "ignored"
        try:
            strategy = parse_strategy_bytes(content, path)
            content = encode_strategy(strategy, strategy.format)  # what it says, not padding a writer added
            digest, fmt, world, stages, error = strategy.content_hash(), strategy.format, strategy.world_size, strategy.stages, None
        except CkptdError as err:
            digest, fmt, world, stages, error = "invalid", "unknown", 0, 0, str(err)
            content = None
            log.warning("strategy file %s does not parse: %s", path, err)
        with self.sessions.begin() as s:
            run = repo.get_or_create_run(s, run_name, os.path.join(self.root, run_name))
            repo.upsert_strategy(s, run, path, digest, fmt, world, stages, error, content, mtime_ns)
            if error is None:
                run.world_size = world
            run_id = run.id
        self._follow_layout_changes(run_id)
        return "same"

    def _ingest_rank_strategies(self, run_name: str) -> str:
        """MindFormers' per-rank strategy files: this node's are recorded, the run's layout is the
        merge of every node's (``ckptd.service.rank_strategies``)."""
        with self.sessions.begin() as s:
            run_id = rank_strategies.ingest(s, self.store, run_name).id
        self._follow_layout_changes(run_id)
        return "same"

    def _ingest_health(self, run_name: str) -> str:
        """MindFormers' health records changed: (re)mark the run's steps they call abnormal."""
        with self.sessions.begin() as s:
            run = reads.run_named(s, run_name)
            if run is None:
                return "same"  # no step yet: each new step reads the records itself
            steps = scanrows.steps_of_kinds(s, run.id, RESAVABLE_KINDS)
            runhints.apply_health(self.store, run, steps)
        return "same"

    def _expected_ranks(self, run: Run, strategy: StrategyFile | None) -> int | None:
        """Strategy file first, then configuration, then the rank directories that exist."""
        if strategy is not None:
            return strategy.world_size
        if self.world_size:
            return self.world_size
        # rank directories holding a shard: an empty (or planted) rank_<n>/ is not a rank of the job
        return sum(1 for d in runlayout.rank_dirs(run.path).values() if self._holds_a_shard(d)) or None

    def _holds_a_shard(self, directory: str) -> bool:
        try:
            return any(e.name.endswith(runlayout.SHARD_SUFFIXES) for e in self.store.entries(directory))
        except OSError:
            return False
