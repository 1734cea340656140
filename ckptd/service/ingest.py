"""Ingest: reconcile the catalog with what is on disk under the checkpoint root.

The full rescan is the source of truth (files that appeared, changed or vanished while nobody
watched are all found); file events only make it fast by examining single paths early. Both
paths end in the same idempotent ``_ingest_shard`` / ``_ingest_strategy``.
"""

from __future__ import annotations

import logging
import os
import stat as stat_mod
import time
from dataclasses import dataclass, field
from typing import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.catalog import repo
from ckptd.catalog.models import Checkpoint, Run, Shard, StrategyFile
from ckptd.errors import CkptdError
from ckptd.format.checkpoint import open_checkpoint
from ckptd.format.strategy import MAX_STRATEGY_BYTES, parse_strategy_bytes
from ckptd.settings import Settings
from ckptd.states import ShardState, StepState

log = logging.getLogger("ckptd.ingest")


@dataclass
class ScanReport:
    shards_seen: int = 0
    shards_new: int = 0
    shards_deleted: int = 0
    unsettled: list[str] = field(default_factory=list)


class Ingestor:
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        submit: Callable[[int], None],
        submit_step: Callable[[int], None],
    ) -> None:
        self.root = str(settings.root)
        self.settings = settings
        self.sessions = sessions
        self.submit = submit  # a shard needs verification
        self.submit_step = submit_step  # a step may be ready for its step-level checks
        self.key = settings.encryption_key()

    # --- entry points --------------------------------------------------------------------------

    def rescan(self, should_stop: Callable[[], bool] = lambda: False) -> ScanReport:
        """Reconcile everything under the root. Files whose size/mtime/inode match a settled
        catalog row are skipped without being opened (one bulk select per rescan), so a rescan
        of an unchanged tree costs a stat per file."""
        report = ScanReport()
        seen: set[str] = set()
        known = self._known_stats()
        try:
            runs = sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
        except FileNotFoundError:
            runs = []
        for run in runs:
            run_path = os.path.join(self.root, run)
            for path in self._strategy_candidates(run_path):
                self.examine(path)
            for rank_path in runlayout.rank_dirs(run_path).values():
                with os.scandir(rank_path) as it:
                    for entry in it:
                        if should_stop():
                            return report
                        if isinstance(runlayout.classify(self.root, entry.path), runlayout.ShardName):
                            report.shards_seen += 1
                            seen.add(entry.path)
                            if self._unchanged(entry, known):
                                continue
                            outcome = self.examine(entry.path)
                            if outcome == "new":
                                report.shards_new += 1
                            elif outcome == "unsettled":
                                report.unsettled.append(entry.path)
        report.shards_deleted = self._reconcile_deleted(seen)
        return report

    def _known_stats(self) -> dict[str, tuple[int, int, int]]:
        """(size, mtime_ns, inode) of every settled (verified/corrupt) shard under the root."""
        prefix = self.root.rstrip(os.sep) + os.sep
        with self.sessions() as s:
            rows = s.execute(
                select(Shard.path, Shard.size, Shard.mtime_ns, Shard.inode).where(
                    Shard.path.startswith(prefix, autoescape=True),
                    Shard.state.in_((ShardState.VERIFIED.value, ShardState.CORRUPT.value)),
                )
            ).all()
        return {p: (size, mtime, inode) for p, size, mtime, inode in rows}

    @staticmethod
    def _unchanged(entry: os.DirEntry, known: dict[str, tuple[int, int, int]]) -> bool:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return False
        return known.get(entry.path) == (st.st_size, st.st_mtime_ns, st.st_ino)

    def examine(self, path: str) -> str:
        """Bring the catalog in line with one path. Returns new|changed|same|unsettled|deleted|ignored."""
        kind = runlayout.classify(self.root, path)
        if isinstance(kind, runlayout.StrategyName):
            return self._ingest_strategy(kind.run, path)
        if isinstance(kind, runlayout.ShardName):
            return self._ingest_shard(kind, path)
        if path.endswith(runlayout.SIDECAR_SUFFIX):
            return self._sidecar(path[: -len(runlayout.SIDECAR_SUFFIX)])
        return "ignored"

    def _sidecar(self, shard_path: str) -> str:
        """A commit hint appeared or changed: (re-)check its shard against it."""
        if not isinstance(runlayout.classify(self.root, shard_path), runlayout.ShardName):
            return "ignored"
        outcome = self.examine(shard_path)
        with self.sessions() as s:
            shard_id = s.execute(select(Shard.id).where(Shard.path == shard_path)).scalar_one_or_none()
        if shard_id is not None and outcome == "same":
            self.submit(shard_id)
        return outcome

    # --- shards --------------------------------------------------------------------------------

    def _ingest_shard(self, name: runlayout.ShardName, path: str) -> str:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return self._vanished(path)
        if not stat_mod.S_ISREG(st.st_mode) or not runlayout.resolves_inside(self.root, path):
            return "ignored"  # symlinks (file or directory) are never followed out of the root
        # MindSpore renames into place then chmods 0400; a writable file may still be growing
        # (an operator's cp), so it must be unchanged for settle_seconds first.
        if st.st_mode & 0o222 and time.time() - st.st_mtime < self.settings.settle_seconds and not os.path.exists(
            runlayout.sidecar_for(path)  # the trainer's "done" sidecar says the write is complete
        ):
            return "unsettled"
        fstat = repo.FileStat(st.st_size, st.st_mtime_ns, st.st_ino)
        parse_error = self._parse_error(path)
        with self.sessions.begin() as s:
            run = repo.get_or_create_run(s, name.run, os.path.join(self.root, name.run))
            if not run.path:  # created by an early health report, before any file was seen
                run.path = os.path.join(self.root, name.run)
            strategy = self._current_strategy(s, run)
            expected = self._expected_ranks(run, strategy)
            ckpt = repo.get_or_create_checkpoint(s, run, name.prefix, name.epoch, name.step, name.kind, expected)
            ckpt = repo.lock_checkpoint(s, ckpt.id)
            if strategy is not None and ckpt.strategy_id is None:
                # a strategy file is authoritative over the rank-directory count
                ckpt.strategy_id, ckpt.expected_ranks = strategy.id, strategy.world_size
            elif ckpt.expected_ranks is None and expected is not None:
                ckpt.expected_ranks = expected
            shard, changed = repo.register_shard(s, ckpt, name.rank, path, fstat, name.format)
            if changed:
                ckpt.step_checks_ok, ckpt.reason = None, None
                if parse_error is not None:
                    repo.record_verification(
                        s, shard.id, fstat, state=ShardState.CORRUPT,
                        values={"error_code": parse_error.code, "error": str(parse_error)}, detail=str(parse_error), seconds=0.0,
                    )
            step_state = repo.recompute_step_state(s, ckpt)
            shard_id, state, ckpt_id = shard.id, shard.state, ckpt.id
        if state == ShardState.COMPLETE.value and parse_error is None:
            self.submit(shard_id)  # also re-queues shards a crashed daemon left unverified
        elif step_state == StepState.PENDING:
            self.submit_step(ckpt_id)  # every shard verified but the step checks never ran (e.g. a crash)
        return "new" if changed else "same"

    def _parse_error(self, path: str) -> CkptdError | None:
        """'complete' requires that the file parses; this reads record headers only."""
        try:
            with open_checkpoint(path, self.key):
                return None
        except CkptdError as err:
            return err
        except OSError as err:
            return CkptdError(f"cannot read: {err.strerror}", path=path)

    def _vanished(self, path: str) -> str:
        with self.sessions.begin() as s:
            ckpt_id = s.execute(select(Shard.checkpoint_id).where(Shard.path == path)).scalar_one_or_none()
            if ckpt_id is None:
                return "ignored"
            ckpt = repo.lock_checkpoint(s, ckpt_id)  # lock order everywhere: checkpoint, then its shards
            shard = s.execute(select(Shard).where(Shard.path == path)).scalar_one()
            if shard.state == ShardState.DELETED.value:
                return "ignored"
            repo.mark_deleted(s, shard)
            repo.recompute_step_state(s, ckpt)
        return "deleted"

    def _reconcile_deleted(self, seen: set[str]) -> int:
        prefix = self.root.rstrip(os.sep) + os.sep
        with self.sessions() as s:
            known = s.execute(
                select(Shard.path).where(Shard.state != ShardState.DELETED.value, Shard.path.startswith(prefix, autoescape=True))
            ).scalars().all()
        gone = [p for p in known if p not in seen and not os.path.exists(p)]
        for path in gone:
            self._vanished(path)
        return len(gone)

    # --- strategies ----------------------------------------------------------------------------

    @staticmethod
    def _strategy_candidates(run_path: str) -> list[str]:
        out = []
        for base in (run_path, os.path.join(run_path, "strategy")):
            try:
                with os.scandir(base) as it:
                    out += [e.path for e in it if e.is_file(follow_symlinks=False)]
            except FileNotFoundError:
                pass
        return sorted(out)

    def _ingest_strategy(self, run_name: str, path: str) -> str:
        try:
            with open(path, "rb") as fh:
                content = fh.read(MAX_STRATEGY_BYTES + 1)
        except OSError:
            return "ignored"
        try:
            strategy = parse_strategy_bytes(content, path)
            digest, fmt, world, stages, error = strategy.content_hash(), strategy.format, strategy.world_size, strategy.stages, None
        except CkptdError as err:
            digest, fmt, world, stages, error = "invalid", "unknown", 0, 0, str(err)
            content = None
            log.warning("strategy file %s does not parse: %s", path, err)
        with self.sessions.begin() as s:
            run = repo.get_or_create_run(s, run_name, os.path.join(self.root, run_name))
            repo.upsert_strategy(s, run, path, digest, fmt, world, stages, error, content)
            if error is None:
                run.world_size = world
        return "same"

    @staticmethod
    def _current_strategy(s: Session, run: Run) -> StrategyFile | None:
        return s.execute(
            select(StrategyFile)
            .where(StrategyFile.run_id == run.id, StrategyFile.error.is_(None))
            .order_by(StrategyFile.seen_at.desc(), StrategyFile.id.desc())
        ).scalars().first()

    def _expected_ranks(self, run: Run, strategy: StrategyFile | None) -> int | None:
        """Strategy file first, then configuration, then the rank directories that exist."""
        if strategy is not None:
            return strategy.world_size
        if self.settings.world_size:
            return self.settings.world_size
        return len(runlayout.rank_dirs(run.path)) or None

    # --- on demand -----------------------------------------------------------------------------

    def shards_to_reverify(self, run: str, step: int | None = None) -> list[int]:
        with self.sessions() as s:
            q = (
                select(Shard.id)
                .join(Checkpoint, Shard.checkpoint_id == Checkpoint.id)
                .join(Run, Checkpoint.run_id == Run.id)
                .where(Run.name == run, Shard.state != ShardState.DELETED.value)
            )
            if step is not None:
                q = q.where(Checkpoint.step == step)
            return list(s.execute(q).scalars())
