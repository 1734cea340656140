"""The verification pipeline: a bounded worker pool that turns ``complete`` shards into
``verified`` or ``corrupt`` ones, then runs the step-level checks once a step is whole.

Call order: ``Verifier(settings, sessions)`` → ``submit(shard_id)`` any number of times (from the
ingest thread; duplicates are coalesced) → ``drain()`` to wait → ``close()``. ``verify_shard`` and
``check_step`` also run synchronously for on-demand re-verification.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from ckptd.catalog import repo
from ckptd.catalog.models import Checkpoint, Shard, StrategyFile
from ckptd.errors import CkptdError
from ckptd.format.checkpoint import open_checkpoint
from ckptd.format.source import MmapSource
from ckptd.format.strategy import Strategy, load_strategy, parse_strategy_bytes
from ckptd.format.verify import verify_file
from ckptd.service.stepcheck import ShardRef, check_step, content_step
from ckptd.runlayout import sidecar_for
from ckptd.settings import Settings
from ckptd.states import ShardState

log = logging.getLogger("ckptd.verifier")
_DIGEST_CHUNK = 64 << 20


def file_digest(path: str) -> str:
    """xxh3-128 of the file's bytes (fast; detects any later change together with size).

    Hashes straight from an mmap, unmapping each chunk once hashed: no buffer to allocate (a
    64 MiB bytearray per call once cost 40 ms for a 200-byte shard) and flat RSS for huge files.
    """
    h = xxhash.xxh3_128()
    src = MmapSource(path)
    try:
        for off in range(0, src.size, _DIGEST_CHUNK):
            n = min(_DIGEST_CHUNK, src.size - off)
            h.update(src.view(off, n))
            src.release(off, n)
    finally:
        src.close()
    return h.hexdigest()


def read_sidecar(path: str) -> dict[str, object] | None:
    """The trainer's commit hint ``<shard>.done`` (JSON: size, xxh3_128), if present and readable."""
    import json

    try:
        with open(sidecar_for(path), "rb") as fh:
            data = json.loads(fh.read(4096))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def stat_of(path: str) -> repo.FileStat | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return repo.FileStat(st.st_size, st.st_mtime_ns, st.st_ino)


class Verifier:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session]) -> None:
        self.settings = settings
        self.sessions = sessions
        self.key = settings.encryption_key()
        self._pool = ThreadPoolExecutor(max_workers=settings.verify_workers, thread_name_prefix="ckptd-verify")
        self._lock = threading.Lock()
        self._queued: dict[int, Future[None]] = {}
        self._checking: set[int] = set()
        self._strategies: dict[tuple[str, str], Strategy] = {}
        self.verified_count = 0
        self.failed_count = 0
        self.verified_bytes = 0
        self.verify_seconds = 0.0

    # --- queue ---------------------------------------------------------------------------------

    def submit(self, shard_id: int) -> None:
        with self._lock:
            if shard_id in self._queued:
                return
            self._queued[shard_id] = self._pool.submit(self._run, shard_id)

    def submit_step(self, ckpt_id: int) -> None:
        key = -ckpt_id  # steps share the queue with shards; negative ids keep them apart
        with self._lock:
            if key in self._queued:
                return
            self._queued[key] = self._pool.submit(self._run_step, ckpt_id)

    def _run_step(self, ckpt_id: int) -> None:
        with self._lock:
            self._queued.pop(-ckpt_id, None)
        try:
            self._maybe_check_step(ckpt_id)
        except Exception:
            log.exception("step checks of checkpoint %s failed unexpectedly", ckpt_id)

    def _run(self, shard_id: int) -> None:
        # The id stays "queued" while it runs: a repeat event for the same file (MindSpore's chmod
        # after the rename) must not verify it twice. A real change mid-run is caught below.
        try:
            outcome = self.verify_shard(shard_id)
        except Exception:  # a bug must not kill the worker pool; the shard stays 'complete' and is retried on rescan
            log.exception("verification of shard %s failed unexpectedly", shard_id)
            outcome = ShardState.COMPLETE
        finally:
            with self._lock:
                self._queued.pop(shard_id, None)
        if outcome is None:
            self.submit(shard_id)  # the file changed while we read it: verify the new version

    def drain(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._queued.values())
            if not pending:
                return
            for fut in pending:
                fut.result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def idle(self) -> bool:
        with self._lock:
            return not self._queued

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # --- one shard -----------------------------------------------------------------------------

    def verify_shard(self, shard_id: int) -> ShardState | None:
        with self.sessions() as s:
            shard = s.get(Shard, shard_id)
            if shard is None:
                return ShardState.DELETED
            path, ckpt_id, known_digest = shard.path, shard.checkpoint_id, shard.digest
        with self.sessions.begin() as s:
            seq = repo.claim_verification(s, shard_id)
        before = stat_of(path)
        if before is None:
            with self.sessions.begin() as s:
                ckpt = repo.lock_checkpoint(s, ckpt_id)  # lock order everywhere: checkpoint, then its shards
                row = s.get(Shard, shard_id)
                if row is not None:
                    repo.mark_deleted(s, row)
                    repo.recompute_step_state(s, ckpt)
            return ShardState.DELETED
        t0 = time.perf_counter()
        values, problems = self._check_file(path)
        if known_digest is not None and values["digest"] != known_digest:
            problems.insert(0, ("content_changed", f"content differs from the digest recorded at ingest ({known_digest[:12]}…)"))
            values["digest"] = known_digest  # keep the evidence of what the file was
        after = stat_of(path)
        if after != before:
            return None  # the file changed under us: the caller re-queues it
        state = ShardState.CORRUPT if problems else ShardState.VERIFIED
        if problems:
            values["error_code"], values["error"] = problems[0][0], "; ".join(msg for _, msg in problems)
        else:
            values["error_code"] = values["error"] = None
        with self.sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)  # lock order everywhere: checkpoint, then its shards
            stored = repo.record_verification(
                s, shard_id, before, state=state, values=values, detail=values.get("error"), seconds=time.perf_counter() - t0,
                seq=seq,
            )
            if stored:
                repo.recompute_step_state(s, ckpt)
        if stored:
            self.verified_bytes += before.size
            self.verify_seconds += time.perf_counter() - t0
            if problems:
                self.failed_count += 1
                log.warning("shard %s is corrupt: %s", path, values["error"])
            else:
                self.verified_count += 1
        self._maybe_check_step(ckpt_id)
        return state

    def _check_file(self, path: str) -> tuple[dict[str, object], list[tuple[str, str]]]:
        values: dict[str, object] = {"digest": file_digest(path)}
        report = verify_file(path, self.key, require_crc=self.settings.require_crc)
        values.update(format=report.format, encryption=report.encryption, crc=report.crc)
        problems = [(p.code, f"{p.message}" + (f" @ byte {p.offset}" if p.offset is not None else "")) for p in report.problems]
        hint = read_sidecar(path)
        if hint is not None and (hint.get("size") != os.path.getsize(path) or hint.get("xxh3_128") not in (None, values["digest"])):
            # after the format checks: a CRC error with its byte offset says more than "differs"
            problems.append(("sidecar_mismatch", f"differs from the trainer's .done record (size {hint.get('size')}, "
                                                 f"digest {str(hint.get('xxh3_128'))[:12]}…)"))
        if self.settings.require_encryption and report.format == "ckpt" and report.encryption is None and not problems:
            problems.append(("policy", "plaintext shard but require_encryption is set"))
        if report.ok:
            try:
                with open_checkpoint(path, self.key) as ck:
                    values["global_step"] = content_step(ck)
            except CkptdError as err:
                problems.append((err.code, err.message))
        return values, problems

    # --- steps ---------------------------------------------------------------------------------

    def strategy_for(self, row: StrategyFile | None) -> Strategy | None:
        if row is None or row.error:
            return None
        key = (row.path, row.content_hash)
        if key not in self._strategies:
            try:  # the content as catalogued: the file on disk may describe a newer layout by now
                self._strategies[key] = (parse_strategy_bytes(row.content, row.path) if row.content is not None
                                         else load_strategy(row.path))
            except CkptdError:
                return None
        return self._strategies[key]

    def _maybe_check_step(self, ckpt_id: int) -> None:
        with self.sessions() as s:
            ckpt = s.get(Checkpoint, ckpt_id)
            if ckpt is None or ckpt.step_checks_ok is not None or ckpt.expected_ranks is None:
                return
            counts = dict(s.execute(select(Shard.state, func.count()).where(
                Shard.checkpoint_id == ckpt_id).group_by(Shard.state)).all())
            if set(counts) != {ShardState.VERIFIED.value} or counts[ShardState.VERIFIED.value] < ckpt.expected_ranks:
                return
        with self._lock:  # the last two shards of a step can finish at the same moment: check once
            if ckpt_id in self._checking:
                return
            self._checking.add(ckpt_id)
        try:
            self.check_step(ckpt_id)
        finally:
            with self._lock:
                self._checking.discard(ckpt_id)

    def check_step(self, ckpt_id: int) -> list[str]:
        """Run the step-level checks now and store the verdict (also used for re-verification)."""
        with self.sessions() as s:
            ckpt = s.get(Checkpoint, ckpt_id)
            if ckpt is None:
                return []
            rows = s.execute(select(Shard.rank, Shard.path, Shard.size, Shard.mtime_ns, Shard.inode).where(
                Shard.checkpoint_id == ckpt_id, Shard.state != ShardState.DELETED.value)).all()
            refs = [ShardRef(r, p) for r, p, *_ in rows]
            strategy = self.strategy_for(s.get(StrategyFile, ckpt.strategy_id) if ckpt.strategy_id else None)
            expected, seed = ckpt.expected_ranks, f"{ckpt.run_id}:{ckpt.step}:"
        t0 = time.perf_counter()
        problems = check_step(refs, expected, strategy, self.key, self.settings.replica_check, self.settings.replica_sample, seed)
        with self.sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)
            now_rows = s.execute(select(Shard.rank, Shard.path, Shard.size, Shard.mtime_ns, Shard.inode).where(
                Shard.checkpoint_id == ckpt_id, Shard.state != ShardState.DELETED.value)).all()
            if sorted(map(tuple, now_rows)) != sorted(map(tuple, rows)):
                return problems  # shards changed while we checked: the verdict would be stale, recheck later
            steps = {st for st in s.execute(select(Shard.global_step).where(Shard.checkpoint_id == ckpt_id)).scalars()}
            ckpt.step_checks_ok = not problems
            ckpt.reason = "; ".join(problems) if problems else None
            if not problems and len(steps) == 1:
                ckpt.global_step = steps.pop()
            repo.add_event(s, ckpt_id, None, "step", "ok" if not problems else "failed", ckpt.reason, time.perf_counter() - t0)
            repo.recompute_step_state(s, ckpt)
        return problems
