"""The verification pipeline: a bounded worker pool that turns ``complete`` shards into
``verified`` or ``corrupt`` ones, then runs the step-level checks once a step is whole.

Call order: ``Verifier(settings, sessions)`` → ``submit([shard ids])`` any number of times (from
the ingest thread; duplicates are coalesced) → ``drain()`` to wait → ``close()``. Workers take
shards in batches: files are read outside transactions, and the verdicts for one checkpoint's
shards are claimed and recorded in one transaction each (a 512-rank step is a burst of 512
shards; per-shard transactions cost more than reading small shards). ``verify_shard`` and
``check_step`` also run synchronously for on-demand re-verification.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import xxhash
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ckptd import confine
from ckptd.catalog import repo, verdicts
from ckptd.catalog.pgbatch import any_of
from ckptd.catalog.models import Shard, StrategyFile, as_utc
from ckptd.catalog.nodes import NodeView
from ckptd.format import mf2
from ckptd.format.checkpoint import CheckpointFile
from ckptd.format.digest import StreamDigest
from ckptd.format.index_cache import IndexCache
from ckptd.format.strategy import Strategy
from ckptd.format.verify import verify_file
from ckptd.runlayout import sidecar_for
from ckptd.service.stepcheck import ShardFacts, content_step, facts_of
from ckptd.service.stepjudge import FactsPlan, StepJudge
from ckptd.settings import Settings
from ckptd.states import ShardState, awaits_verification

log = logging.getLogger("ckptd.verifier")


#: shards from which verification also takes the step check's facts: those the step check would
#: otherwise read a second time at a cost (encrypted files are decrypted whole to index them; large
#: plaintext ones may have left the page cache). A small plaintext shard is re-indexed from the
#: index cache for free, and computing its facts on the verifier's hot path measurably delays the
#: verification of a 512-rank burst (bench/RESULTS.md, issue 16).
FACTS_IN_PASS_BYTES = 32 << 20


@dataclass(frozen=True)
class _FactsJob:
    """Facts to take of one shard while verifying it: its rank and the claim's sequence number
    (the facts are valid for that verification only)."""

    plan: FactsPlan
    rank: int
    seq: int


def file_digest(path: str) -> str:
    """xxh3-128 of the file's bytes (fast; detects any later change together with size).

    Hashes straight from an mmap, unmapping each chunk once hashed: no buffer to allocate (a
    64 MiB bytearray per call once cost 40 ms for a 200-byte shard) and flat RSS for huge files.
    """
    return StreamDigest().finish(path)  # nothing consumed yet: finish hashes the whole file


def read_sidecar(root: str, path: str) -> dict[str, object] | None:
    """The trainer's commit hint ``<shard>.done`` (JSON: size, xxh3_128), if present, a regular
    file inside the root (never a symlink or FIFO: ``ckptd.confine``) and readable."""
    sidecar = sidecar_for(path)
    if not os.path.lexists(sidecar):  # the usual case (MindSpore writes none): one lstat, no walk from the root
        return None
    try:
        data = json.loads(confine.read_beneath(root, sidecar, 4096))
    except (OSError, ValueError, RecursionError, confine.ConfinementError):  # RecursionError: [[[[... nesting
        return None
    return data if isinstance(data, dict) else None


def stat_of(path: str) -> repo.FileStat | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return repo.FileStat(st.st_size, st.st_mtime_ns, st.st_ino)


_BATCH = 128  # shards one worker verifies and records per round (one transaction per checkpoint)


@dataclass
class _Outcome:
    stat: repo.FileStat | None  # None: the file is gone
    state: ShardState | None = None  # None: the file changed while it was read
    values: dict[str, object] = field(default_factory=dict)
    seconds: float = 0.0


def _answered(ask: datetime | None, verified_at: datetime | None, awaits: bool) -> bool:
    """Whether a queued ask (see ``Verifier.submit``) was answered since, by another daemon on a
    shared root: ``awaits`` is whether the shard still needs a verdict under this daemon's
    configuration (``states.awaits_verification``)."""
    if awaits:
        return False
    return ask is None or (verified_at is not None and as_utc(verified_at) >= ask)


class Verifier:
    """Call order: ``submit([ids])`` / ``submit_step(id)`` any time → ``drain()`` → ``close()``."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], index_cache: IndexCache | None = None,
                 nodes: NodeView | None = None) -> None:
        self.settings = settings
        self.index_cache = index_cache
        self.sessions = sessions
        # only the node that sees a file judges it; several nodes on one shared root split the work
        self.nodes = nodes or NodeView(sessions, settings.node_name, settings.node_timeout, root=str(settings.root))
        self.steps = StepJudge(settings, sessions, settings.encryption_key(), index_cache)
        self.key = settings.encryption_key()
        self.stamp = settings.verification_stamp()
        self._cond = threading.Condition()
        # shard id -> its ask (see submit: None while unverified, else the time asked);
        # insertion-ordered (FIFO) and de-duplicated
        self._pending: dict[int, datetime | None] = {}
        self._steps: dict[int, None] = {}  # checkpoint ids waiting for their step checks
        self._inflight: set[int] = set()
        self._active = 0
        self._busy_since: dict[str, float] = {}  # worker -> when its current unit of work began
        self._closed = False
        self._checking: set[int] = set()
        self._check_again: set[int] = set()  # asked for while claimed (see _maybe_check_step)
        self.verified_count = 0
        self.failed_count = 0
        self.verified_bytes = 0
        self.verify_seconds = 0.0
        self._workers = [
            threading.Thread(target=self._work, name=f"ckptd-verify-{i}", daemon=True) for i in range(settings.verify_workers)
        ]
        for t in self._workers:
            t.start()

    # --- queue ---------------------------------------------------------------------------------

    def submit(self, shard_ids: list[int], *, if_unverified: bool = False) -> None:
        """Queue shards for verification. An id already queued or being verified is not queued
        again: MindSpore's chmod after the rename must not verify a file twice (a real change
        mid-read is detected by the verification itself, which then re-queues).

        ``if_unverified``: verify a shard only while it has no verdict under this daemon's
        configuration (ingest's new files, a rescan's re-queues; ``states.awaits_verification``).
        Decided under the checkpoint's lock, so a verdict another daemon on a shared root stored
        meanwhile is never repeated, however late the caller read the state.
        Otherwise (scrub, a changed sidecar): verify again, unless another daemon verifies it
        after this call."""
        ask = None if if_unverified else datetime.now(timezone.utc)
        with self._cond:
            for shard_id in shard_ids:
                if shard_id in self._inflight:
                    continue
                # a time asked ("again") covers "while unverified"; of two times, the earlier
                times = [t for t in (self._pending.get(shard_id), ask) if t is not None]
                self._pending[shard_id] = min(times, default=None)
            self._cond.notify_all()

    def submit_step(self, ckpt_id: int) -> None:
        with self._cond:
            self._steps[ckpt_id] = None
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._steps and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                step = next(iter(self._steps)) if self._steps else None
                if step is not None:
                    del self._steps[step]
                    batch: list[int] = []
                else:
                    # whole batches, not a fair share: splitting a shrinking queue between workers
                    # ends a burst in a tail of tiny batches, each paying two transactions
                    batch = list(itertools.islice(self._pending, _BATCH))
                    asks = {shard_id: self._pending.pop(shard_id) for shard_id in batch}
                    self._inflight.update(batch)
                self._active += 1
                self._busy_since[threading.current_thread().name] = time.monotonic()
            try:
                if step is not None:
                    self._maybe_check_step(step)
                else:
                    self._verify_queued(batch, asks)
            except Exception:  # a bug must not kill a worker; the shards stay 'complete' and the next rescan re-queues them
                log.exception("verification of %s failed unexpectedly", f"checkpoint {step}" if step is not None else f"{len(batch)} shards")
            finally:
                with self._cond:
                    self._busy_since.pop(threading.current_thread().name, None)
                    self._inflight.difference_update(batch)
                    self._active -= 1
                    self._cond.notify_all()

    def _verify_queued(self, batch: list[int], asks: dict[int, datetime | None]) -> None:
        outcomes = self.verify_shards(batch, asks)
        again = [shard_id for shard_id, state in outcomes.items() if state is None]
        if again:
            with self._cond:  # the file changed while we read it: verify the new version
                self._inflight.difference_update(again)
            self.submit(again)

    def drain(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._steps or self._active:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("verification still running")
                self._cond.wait(left)

    def stalled(self, seconds: float) -> dict[str, float]:
        """Workers busy with one unit of work (a batch, a step check) for longer than ``seconds``:
        a hung file system or a bug; ``/healthz`` reports them."""
        now = time.monotonic()
        with self._cond:
            return {name: now - t for name, t in self._busy_since.items() if now - t > seconds}

    def idle(self) -> bool:
        with self._cond:
            return not (self._pending or self._steps or self._active)

    def close(self) -> None:
        """Stop the workers; queued work is dropped (the next start's rescan re-queues it)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._steps.clear()
            self._cond.notify_all()
        deadline = time.monotonic() + 10  # shutdown is bounded: a worker stuck in I/O is a daemon thread
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("verification worker %s did not stop in time; exiting without it", t.name)

    def due_for_scrub(self, root: str, max_age: float, limit: int) -> list[int]:
        """Verified shards under ``root`` whose last verification is older than ``max_age``
        seconds, oldest first (index ``ix_shards_state_verified_at``). Re-verifying them compares
        the bytes with the digest taken at ingest, so in-place corruption that keeps size and
        mtime (which a rescan cannot see) turns the shard — and its step — corrupt."""
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=max_age)
        prefix = root.rstrip(os.sep) + os.sep
        with self.sessions() as s:
            return list(s.execute(
                select(Shard.id)
                .where(Shard.state == ShardState.VERIFIED.value, Shard.verified_at < cutoff,
                       Shard.path.startswith(prefix, autoescape=True), self.nodes.owner().owned_clause())
                .order_by(Shard.verified_at)
                .limit(limit)
            ).scalars())

    # --- shards --------------------------------------------------------------------------------

    def verify_shard(self, shard_id: int) -> ShardState | None:
        """Verify one shard now (on-demand re-verification). None: it changed while being read."""
        return self.verify_shards([shard_id]).get(shard_id, ShardState.DELETED)

    def verify_shards(self, shard_ids: list[int], asks: dict[int, datetime | None] | None = None) -> dict[int, ShardState | None]:
        """Verify shards and store the verdicts: the files are read outside any transaction, the
        results of each checkpoint's shards are claimed and recorded in one transaction each.
        ``asks``: the queue's conditions (see ``submit``); a shard not in it is verified now."""
        with self.sessions() as s:
            rows = s.execute(select(Shard.id, Shard.path, Shard.checkpoint_id, Shard.digest, Shard.state)
                             .where(any_of(s, Shard.id, shard_ids))).all()
        result: dict[int, ShardState | None] = {shard_id: ShardState.DELETED for shard_id in shard_ids}
        by_ckpt: dict[int, list[tuple[int, str, str | None]]] = {}
        for shard_id, path, ckpt_id, digest, state in rows:
            if state == ShardState.SUPERSEDED.value:
                # not part of any step (its verdict would never be stored), and its row now sits
                # under a history row, which may only be locked after its step
                result[shard_id] = ShardState.SUPERSEDED
                continue
            by_ckpt.setdefault(ckpt_id, []).append((shard_id, path, digest))
        for ckpt_id in sorted(by_ckpt):
            result.update(self._verify_checkpoint_shards(ckpt_id, by_ckpt[ckpt_id], asks or {}))
            self._maybe_check_step(ckpt_id)
        return result

    def _verify_checkpoint_shards(self, ckpt_id: int, shards: list[tuple[int, str, str | None]],
                                  asks: dict[int, datetime | None]) -> dict[int, ShardState | None]:
        owner = self.nodes.owner()
        with self.sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)  # lock order everywhere: checkpoint, then its shards
            # verified (by another daemon on a shared root) since we were asked: done, not again
            asked = [sid for sid, _, _ in shards if sid in asks]
            done = {sid for sid, state, stamp, code, at in s.execute(
                select(Shard.id, Shard.state, Shard.verified_config, Shard.error_code, Shard.verified_at)
                .where(any_of(s, Shard.id, asked))).all()
                if _answered(asks[sid], at, awaits_verification(state, stamp, code, self.stamp))} if asked else set()
            claims = verdicts.claim_verifications(s, [shard_id for shard_id, _, _ in shards if shard_id not in done], owner)
            plan = self.steps.facts_plan(s, ckpt) if claims else None
        skipped = {shard_id for shard_id, _, _ in shards if shard_id not in claims}  # another live node verifies them
        shards = [sh for sh in shards if sh[0] in claims]
        t0 = time.perf_counter()
        outcomes = {shard_id: self._read_shard(path, digest, _FactsJob(plan, claims[shard_id].rank, claims[shard_id].seq)
                                               if plan is not None else None)
                    for shard_id, path, digest in shards}
        t1 = time.perf_counter()
        paths = {shard_id: path for shard_id, path, _ in shards}
        result: dict[int, ShardState | None] = {shard_id: out.state for shard_id, out in outcomes.items()}
        found = [
            verdicts.Verdict(shard_id, out.stat, out.state, out.values, claims[shard_id].seq, out.seconds)
            for shard_id, out in outcomes.items() if out.stat is not None and out.state is not None
        ]
        missing = [shard_id for shard_id, out in outcomes.items() if out.stat is None]
        # a file we cannot see is gone only if it is ours; another node's file is its to judge
        gone = [shard_id for shard_id in missing if owner.may_judge_gone(claims[shard_id].node)]
        with self.sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)
            if gone:
                for row in s.execute(select(Shard).where(Shard.id.in_(gone), Shard.state != ShardState.DELETED.value)).scalars():
                    repo.mark_deleted(s, row)
            verdicts.release_claims(s, [sid for sid in missing if sid not in gone]
                                    + [sid for sid, out in outcomes.items() if out.stat is not None and out.state is None], owner)
            stored = verdicts.record_verifications(s, ckpt_id, found)
            if stored or gone:
                repo.recompute_step_state(s, ckpt)
        log.debug("checkpoint %d: %d shards read in %.3f s, verdicts stored in %.3f s",
                  ckpt_id, len(shards), t1 - t0, time.perf_counter() - t1)
        for shard_id in gone:
            result[shard_id] = ShardState.DELETED
        for shard_id in skipped | (set(missing) - set(gone)):
            result[shard_id] = ShardState.COMPLETE  # not ours to judge now: no verdict, nothing to retry
        for v in found:
            if v.shard_id not in stored:
                continue
            self.verified_bytes += v.stat.size
            self.verify_seconds += v.seconds
            if v.state == ShardState.CORRUPT:
                self.failed_count += 1
                log.warning("shard %s is corrupt: %s", paths[v.shard_id], v.values["error"])
            else:
                self.verified_count += 1
        return result

    def _read_shard(self, path: str, known_digest: str | None, facts: _FactsJob | None = None) -> _Outcome:
        before = stat_of(path)
        if before is None:
            return _Outcome(None)
        t0 = time.perf_counter()
        try:
            # the very file that passed confinement (never a symlink, FIFO or device) is read, by
            # descriptor: a name swapped meanwhile cannot redirect the read (ckptd.confine)
            with confine.opened(str(self.settings.root), path) as name:
                values, problems = (self._check_record(name, path) if path.endswith(".json")
                                    else self._check_file(name, path, facts, first=known_digest is None))
        except confine.ConfinementError as err:
            values, problems = {"digest": known_digest}, [(err.code, err.message)]
        except FileNotFoundError:
            return _Outcome(None)
        if known_digest is not None and values["digest"] != known_digest:
            problems.insert(0, ("content_changed", f"content differs from the digest recorded at ingest ({known_digest[:12]}…)"))
            values["digest"] = known_digest  # keep the evidence of what the file was
        if stat_of(path) != before:
            return _Outcome(before, None)  # the file changed under us: verify the new version
        if problems:
            values["error_code"], values["error"] = problems[0][0], "; ".join(msg for _, msg in problems)
        else:
            values["error_code"] = values["error"] = None
        values["verified_config"] = self.stamp  # what this verdict depended on besides the file
        state = ShardState.CORRUPT if problems else ShardState.VERIFIED
        return _Outcome(before, state, values, time.perf_counter() - t0)

    def _check_file(self, name: str, path: str, facts: _FactsJob | None = None, *, first: bool = False,
                    ) -> tuple[dict[str, object], list[tuple[str, str]]]:
        """Verify the file opened as ``name`` (a ``/proc/self/fd`` name) that is ``path``; with
        ``facts``, also take the step check's facts of it from the same open file. ``first``: no
        verdict recorded a digest yet, so the record index ingest parsed seconds ago (same inode,
        size, mtime and ctime: the same bytes as written) is reused; a later verification (a scrub
        looking for damage below the file system) parses the records from the bytes again."""
        # one pass over the disk: the digest hashes the bytes the CRC / decryption reads anyway,
        # and the step check's facts come from the index and payloads this verification opened
        digest = StreamDigest()

        def inspect(ck: CheckpointFile) -> tuple[int | None, ShardFacts | None]:
            if facts is None or (ck.encryption is None and ck.source.size < FACTS_IN_PASS_BYTES):
                return content_step(ck), None
            plan = facts.plan
            return content_step(ck), facts_of(ck, facts.rank, plan.strategy, plan.names, subset=plan.subset)

        report = verify_file(name, self.key, require_crc=self.settings.require_crc, inspect=inspect, digest=digest,
                             index_cache=self.index_cache if first else None)
        values: dict[str, object] = {"digest": digest.finish(name)}
        values.update(format=report.format, encryption=report.encryption, crc=report.crc)
        if report.ok:
            values["global_step"], found = report.inspected
            if found is not None:  # taken only with a facts job
                values["facts"] = facts.plan.encode(found, facts.seq)
        problems = [(p.code, f"{p.message}" + (f" @ byte {p.offset}" if p.offset is not None else "")) for p in report.problems]
        hint = read_sidecar(str(self.settings.root), path)
        if hint is not None and (hint.get("size") != os.path.getsize(name) or hint.get("xxh3_128") not in (None, values["digest"])):
            # after the format checks: a CRC error with its byte offset says more than "differs"
            problems.append(("sidecar_mismatch", f"differs from the trainer's .done record (size {hint.get('size')}, "
                                                 f"digest {str(hint.get('xxh3_128'))[:12]}…)"))
        if self.settings.require_encryption and report.format == "ckpt" and report.encryption is None and not problems:
            problems.append(("policy", "plaintext shard but require_encryption is set"))
        return values, problems

    @staticmethod
    def _check_record(name: str, path: str) -> tuple[dict[str, object], list[tuple[str, str]]]:
        """A Checkpoint 2.0 JSON record (``common.json``, ``metadata.json``): it must parse as
        MindFormers writes it; what it says is judged with the iteration (ckptd.service.iteration)."""
        with open(name, "rb") as fh:
            raw = fh.read(mf2.MAX_METADATA_BYTES + 1)
        values: dict[str, object] = {"digest": xxhash.xxh3_128_hexdigest(raw), "format": "json", "encryption": None,
                                     "crc": "absent"}
        problem = mf2.record_problem(raw, path)
        return values, [] if problem is None else [(problem.code, str(problem))]

    # --- steps ---------------------------------------------------------------------------------

    def strategy_for(self, row: StrategyFile | None) -> Strategy | None:
        return self.steps.strategy_for(row)

    def _maybe_check_step(self, ckpt_id: int) -> None:
        """Run the step checks if they are due, once. The last two shards of a step can finish at
        the same moment, and a rescan can ask again meanwhile: one caller claims the step, and
        reads whether checks are due only after claiming (a check that finished just before has
        committed its verdict by then). A caller refused because the step is claimed leaves a note,
        and the holder reads once more before letting go: the refused caller may have committed
        the step's last verdict after the holder's read."""
        with self._cond:
            if ckpt_id in self._checking:
                self._check_again.add(ckpt_id)
                return
            self._checking.add(ckpt_id)
        try:
            while True:
                if self._step_ready(ckpt_id):
                    self.steps.check(ckpt_id, unjudged_only=True)
                with self._cond:  # decide and let go under one lock: no note can slip in between
                    if ckpt_id not in self._check_again:
                        self._checking.discard(ckpt_id)
                        return
                    self._check_again.discard(ckpt_id)
        except BaseException:
            with self._cond:
                self._checking.discard(ckpt_id)
                self._check_again.discard(ckpt_id)
            raise

    def _step_ready(self, ckpt_id: int) -> bool:
        return self.steps.ready(ckpt_id)

    def check_step(self, ckpt_id: int) -> list[str]:
        """Run the step-level checks now and store the verdict (also used for re-verification)."""
        return self.steps.check(ckpt_id)
