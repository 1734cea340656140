"""Verification in three levels, each usable without the next:

* ``verify_one(rules, path, ...)``, a plain function: one file below the root (read through
  the rules' confined store) → a :class:`ShardOutcome`; no catalog, no threads.
* ``ShardVerifier``, on the caller's thread (``ckptd verify --run``, re-verification jobs):
  ``verify_shards(ids)`` works one checkpoint at a time: claims its shards in one transaction
  (checkpoint row locked before its shard rows), reads the files outside any, records the
  verdicts in one (each iff the size/mtime/inode read are still the shard's), then runs the step
  checks if due. ``check_step`` forces them.
* ``Verifier(ShardVerifier)``, the daemon's: ``verify_workers`` threads over a
  :class:`~ckptd.service.workqueue.KeyedQueue` keyed by checkpoint. ``submit([ids])`` /
  ``submit_step(id)`` any time → ``drain()`` → ``close()``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime, timedelta, timezone

import xxhash
from sqlalchemy.orm import Session, sessionmaker

from ckptd.catalog import repo, verdicts
from ckptd.catalog.models import as_utc
from ckptd.catalog.nodes import NodeView
from ckptd.format import mf2
from ckptd.format.checkpoint import CheckpointFile
from ckptd.format.digest import StreamDigest
from ckptd.format.index_cache import IndexCache
from ckptd.format.verify import verify_file
from ckptd.runlayout import sidecar_for
from ckptd.service.stepcheck import ShardFacts, content_step, facts_of
from ckptd.service.stepjudge import FactsPlan, StepJudge
from ckptd.service.workqueue import KeyedQueue
from ckptd.states import ShardState, awaits_verification
from ckptd.storage import ConfinementError, PosixStorage

log = logging.getLogger("ckptd.verifier")


#: shards from which verification also takes the step check's facts: those the step check would
#: otherwise read a second time at a cost (encrypted files are decrypted whole to index them; large
#: plaintext ones may have left the page cache). A small plaintext shard is re-indexed from the
#: index cache for free, and computing its facts on the verifier's hot path measurably delays the
#: verification of a 512-rank burst (bench/RESULTS.md, issue 16).
FACTS_IN_PASS_BYTES = 32 << 20

_BATCH = 128  # shards one worker verifies and records per unit of work (one checkpoint's, one transaction)


def file_digest(path: str) -> str:
    """xxh3-128 of the file's bytes (fast; detects any later change together with size).

    Hashes straight from an mmap, unmapping each chunk once hashed: no buffer to allocate (a
    64 MiB bytearray per call once cost 40 ms for a 200-byte shard) and flat RSS for huge files.
    """
    return StreamDigest().finish(path)  # nothing consumed yet: finish hashes the whole file


def read_sidecar(store: PosixStorage, path: str) -> dict[str, object] | None:
    """The trainer's commit hint ``<shard>.done`` (JSON: size, xxh3_128), if present, a regular
    file inside the root (never a symlink or FIFO: the store is confined) and readable."""
    sidecar = sidecar_for(path)
    if not store.exists(sidecar):  # the usual case (MindSpore writes none): one lstat, no walk from the root
        return None
    try:
        data = json.loads(store.read(sidecar, 4096))
    except (OSError, ValueError, RecursionError, ConfinementError):  # RecursionError: [[[[... nesting
        return None
    return data if isinstance(data, dict) else None


def stat_of(store: PosixStorage, path: str) -> repo.FileStat | None:
    st = store.stat(path)
    return None if st is None else repo.FileStat(st.st_size, st.st_mtime_ns, st.st_ino)


# --- one shard ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardRules:
    """Where shards are read, what they must satisfy besides their own format, and the key to
    read them with; ``stamp`` names the configuration a verdict depends on besides the file
    (``Settings.verification_stamp``: a daemon with another one re-verifies)."""

    store: PosixStorage
    key: bytes | None = None
    require_crc: bool = False
    require_encryption: bool = False
    stamp: str = ""


@dataclass(frozen=True)
class FactsJob:
    """Facts to take of one shard while verifying it: its rank and the claim's sequence number
    (the facts are valid for that verification only)."""

    plan: FactsPlan
    rank: int
    seq: int


@dataclass(frozen=True)
class ShardOutcome:
    """What verifying one file found. ``stat`` None: the file is gone; ``state`` None: it changed
    while it was read (verify the new version). Otherwise ``state`` is ``verified`` or ``corrupt``
    (``error_code``/``error``: the first problem's code, every problem's message)."""

    stat: repo.FileStat | None
    state: ShardState | None = None
    digest: str | None = None
    format: str | None = None
    encryption: str | None = None
    crc: str | None = None
    global_step: int | None = None
    facts: str | None = None  # ``shards.facts``: taken with a facts job only
    error_code: str | None = None
    error: str | None = None
    seconds: float = 0.0

    def columns(self) -> dict[str, object]:
        """The verdict's shard columns (``verdicts.Verdict.values``)."""
        return {c: getattr(self, c) for c in _OUTCOME_COLUMNS}


_OUTCOME_COLUMNS = tuple(f.name for f in fields(ShardOutcome) if f.name not in ("stat", "state", "seconds"))


def verify_one(rules: ShardRules, path: str, known_digest: str | None = None, facts: FactsJob | None = None,
               index_cache: IndexCache | None = None) -> ShardOutcome:
    """Verify the shard file ``path`` completely. ``known_digest``: the digest a verdict recorded
    (the content must still have it); with none, this is the first verification and the record
    index ingest parsed seconds ago (same inode, size, mtime and ctime: the same bytes as
    written) is reused from ``index_cache``; a later one (a scrub looking for damage below the
    file system) parses the records from the bytes again."""
    before = stat_of(rules.store, path)
    if before is None:
        return ShardOutcome(None)
    t0 = time.perf_counter()
    try:
        # the very file that passed confinement (never a symlink, FIFO or device) is read, by
        # descriptor: a name swapped meanwhile cannot redirect the read
        with rules.store.opened(path) as name:
            found, problems = (_check_record(name, path) if path.endswith(".json")
                               else _check_file(rules, name, path, facts, index_cache if known_digest is None else None))
    except ConfinementError as err:
        found, problems = {"digest": known_digest}, [(err.code, err.message)]
    except FileNotFoundError:
        return ShardOutcome(None)
    if known_digest is not None and found["digest"] != known_digest:
        problems.insert(0, ("content_changed", f"content differs from the digest recorded at ingest ({known_digest[:12]}…)"))
        found["digest"] = known_digest  # keep the evidence of what the file was
    if stat_of(rules.store, path) != before:
        return ShardOutcome(before)  # the file changed under us: verify the new version
    return ShardOutcome(before, ShardState.CORRUPT if problems else ShardState.VERIFIED,
                        error_code=problems[0][0] if problems else None,
                        error="; ".join(msg for _, msg in problems) or None, seconds=time.perf_counter() - t0, **found)


def _check_file(rules: ShardRules, name: str, path: str, facts: FactsJob | None, index_cache: IndexCache | None,
                ) -> tuple[dict, list[tuple[str, str]]]:
    """Verify the file opened as ``name`` (a ``/proc/self/fd`` name) that is ``path``; with
    ``facts``, also take the step check's facts of it from the same open file."""
    # one pass over the disk: the digest hashes the bytes the CRC / decryption reads anyway,
    # and the step check's facts come from the index and payloads this verification opened
    digest = StreamDigest()

    def inspect(ck: CheckpointFile) -> tuple[int | None, ShardFacts | None]:
        if facts is None or (ck.encryption is None and ck.source.size < FACTS_IN_PASS_BYTES):
            return content_step(ck), None
        plan = facts.plan
        return content_step(ck), facts_of(ck, facts.rank, plan.strategy, plan.names, subset=plan.subset)

    report = verify_file(name, rules.key, require_crc=rules.require_crc, inspect=inspect, digest=digest,
                         index_cache=index_cache)
    found: dict = {"digest": digest.finish(name), "format": report.format, "encryption": report.encryption,
                   "crc": report.crc}
    if report.ok:
        found["global_step"], taken = report.inspected
        if taken is not None:  # taken only with a facts job
            found["facts"] = facts.plan.encode(taken, facts.seq)
    problems = [(p.code, f"{p.message}" + (f" @ byte {p.offset}" if p.offset is not None else "")) for p in report.problems]
    hint = read_sidecar(rules.store, path)
    if hint is not None and (hint.get("size") != os.path.getsize(name) or hint.get("xxh3_128") not in (None, found["digest"])):
        # after the format checks: a CRC error with its byte offset says more than "differs"
        problems.append(("sidecar_mismatch", f"differs from the trainer's .done record (size {hint.get('size')}, "
                                             f"digest {str(hint.get('xxh3_128'))[:12]}…)"))
    if rules.require_encryption and report.format == "ckpt" and report.encryption is None and not problems:
        problems.append(("policy", "plaintext shard but require_encryption is set"))
    return found, problems


def _check_record(name: str, path: str) -> tuple[dict, list[tuple[str, str]]]:
    """A Checkpoint 2.0 JSON record (``common.json``, ``metadata.json``): it must parse as
    MindFormers writes it; what it says is judged with the iteration (ckptd.service.iteration)."""
    with open(name, "rb") as fh:
        raw = fh.read(mf2.MAX_METADATA_BYTES + 1)
    found = {"digest": xxhash.xxh3_128_hexdigest(raw), "format": "json", "encryption": None, "crc": "absent"}
    problem = mf2.record_problem(raw, path)
    return found, [] if problem is None else [(problem.code, str(problem))]


# --- a checkpoint's shards, with the catalog -----------------------------------------------------


def _answered(ask: datetime | None, verified_at: datetime | None, awaits: bool) -> bool:
    """Whether a queued ask (see ``Verifier.submit``) was answered since, by another daemon on a
    shared root: ``awaits`` is whether the shard still needs a verdict under this daemon's
    configuration (``states.awaits_verification``)."""
    if awaits:
        return False
    return ask is None or (verified_at is not None and as_utc(verified_at) >= ask)


def _earlier_ask(a: datetime | None, b: datetime | None) -> datetime | None:
    """Two asks for one shard: a time asked ("again") covers "while unverified"; of two times, the earlier."""
    return min((t for t in (a, b) if t is not None), default=None)


class ShardVerifier:
    """Verification on the caller's thread; the counters are what ``/metrics`` reports.

    ``on_verified``: called with the mtimes (ns) of the files whose *first* verdict ``verified``
    was just stored (the daemon's rename-to-verified latency; re-verifications are not first)."""

    def __init__(self, rules: ShardRules, sessions: sessionmaker[Session], steps: StepJudge, nodes: NodeView,
                 index_cache: IndexCache | None = None, *,
                 on_verified: Callable[[list[int]], None] | None = None) -> None:
        self.rules, self.sessions, self.steps, self.index_cache = rules, sessions, steps, index_cache
        self.on_verified = on_verified
        # only the node that sees a file judges it; several nodes on one shared root split the work
        self.nodes = nodes
        self.stamp = rules.stamp  # what a verdict depended on besides the file
        self._counting = threading.Lock()  # workers and a re-verification job count at once
        self.verified_count = self.failed_count = self.verified_bytes = 0
        self.verify_seconds = 0.0

    def verify_shards(self, shard_ids: list[int], asks: dict[int, datetime | None] | None = None,
                      ) -> dict[int, ShardState | None]:
        """Verify shards now and store the verdicts, one checkpoint at a time; then each
        checkpoint's step checks if due. ``asks``: the queue's conditions (see ``Verifier.submit``);
        a shard not in it is verified now. A shard's result: its new state, ``complete`` when it
        is not this node's to judge now, None when it changed while read."""
        with self.sessions() as s:
            rows = verdicts.shard_targets(s, shard_ids)
        result: dict[int, ShardState | None] = dict.fromkeys(shard_ids, ShardState.DELETED)
        by_ckpt: dict[int, list[tuple[int, str, str | None]]] = {}
        for shard_id, path, ckpt_id, digest, state in rows:
            if state == ShardState.SUPERSEDED.value:
                # not part of any step (its verdict would never be stored), and its row now sits
                # under a history row, which may only be locked after its step
                result[shard_id] = ShardState.SUPERSEDED
                continue
            by_ckpt.setdefault(ckpt_id, []).append((shard_id, path, digest))
        for ckpt_id in sorted(by_ckpt):
            result.update(self._verify_checkpoint(ckpt_id, by_ckpt[ckpt_id], asks or {}))
            self.check_step_if_due(ckpt_id)
        return result

    def _verify_checkpoint(self, ckpt_id: int, shards: list[tuple[int, str, str | None]],
                           asks: dict[int, datetime | None]) -> dict[int, ShardState | None]:
        owner = self.nodes.owner()
        with self.sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)  # lock order everywhere: checkpoint, then its shards
            # verified (by another daemon on a shared root) since we were asked: done, not again
            asked = [sid for sid, _, _ in shards if sid in asks]
            done = {sid for sid, state, stamp, code, at in verdicts.verdict_states(s, asked)
                    if _answered(asks[sid], at, awaits_verification(state, stamp, code, self.stamp))}
            claims = verdicts.claim_verifications(s, [sid for sid, _, _ in shards if sid not in done], owner)
            plan = self.steps.facts_plan(s, ckpt) if claims else None
        # not claimed: another live node verifies them, or they were answered
        result: dict[int, ShardState | None] = {sid: ShardState.COMPLETE for sid, _, _ in shards if sid not in claims}
        t0 = time.perf_counter()
        outcomes = {sid: verify_one(self.rules, path, digest, None if plan is None else
                                    FactsJob(plan, claims[sid].rank, claims[sid].seq), self.index_cache)
                    for sid, path, digest in shards if sid in claims}
        t1 = time.perf_counter()
        found = [verdicts.Verdict(sid, out.stat, out.state, out.columns() | {"verified_config": self.stamp},
                                  claims[sid].seq, out.seconds)
                 for sid, out in outcomes.items() if out.stat is not None and out.state is not None]
        missing = [sid for sid, out in outcomes.items() if out.stat is None]
        # a file we cannot see is gone only if it is ours; another node's file is its to judge
        gone = [sid for sid in missing if owner.may_judge_gone(claims[sid].node)]
        with self.sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)
            if gone:
                for row in verdicts.live_shards(s, gone):
                    repo.mark_deleted(s, row)
            verdicts.release_claims(s, [sid for sid, out in outcomes.items() if sid not in gone and out.state is None], owner)
            stored = verdicts.record_verifications(s, ckpt_id, found)
            if stored or gone:
                repo.recompute_step_state(s, ckpt)
        log.debug("checkpoint %d: %d shards read in %.3f s, verdicts stored in %.3f s",
                  ckpt_id, len(outcomes), t1 - t0, time.perf_counter() - t1)
        for sid, out in outcomes.items():
            # None: changed while read; complete: gone but another node's to judge
            result[sid] = ShardState.DELETED if sid in gone else ShardState.COMPLETE if out.stat is None else out.state
        counted = [v for v in found if v.shard_id in stored]
        bad = [v for v in counted if v.state == ShardState.CORRUPT]
        with self._counting:
            self.verified_bytes += sum(v.stat.size for v in counted)
            self.verify_seconds += sum(v.seconds for v in counted)
            self.failed_count += len(bad)
            self.verified_count += len(counted) - len(bad)
        if self.on_verified is not None:
            # no digest recorded before: the file is new at its name (ingest clears it for a rewritten one)
            fresh = {sid for sid, _, digest in shards if digest is None}
            mtimes = [v.stat.mtime_ns for v in counted if v.state == ShardState.VERIFIED and v.shard_id in fresh]
            if mtimes:
                self.on_verified(mtimes)
        paths = {sid: path for sid, path, _ in shards}
        for v in bad:
            log.warning("shard %s is corrupt: %s", paths[v.shard_id], v.values["error"])
        return result

    def due_for_scrub(self, max_age: float, limit: int) -> list[int]:
        """Verified shards under the root whose last verification is older than ``max_age``
        seconds, oldest first (index ``ix_shards_state_verified_at``). Re-verifying them compares
        the bytes with the digest taken at ingest, so in-place corruption that keeps size and
        mtime (which a rescan cannot see) turns the shard — and its step — corrupt."""
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=max_age)
        prefix = self.rules.store.root.rstrip(os.sep) + os.sep
        with self.sessions() as s:
            return verdicts.verified_before(s, prefix, cutoff, self.nodes.owner(), limit)

    # --- steps ---------------------------------------------------------------------------------

    def check_step_if_due(self, ckpt_id: int) -> None:
        """Run the step checks if they are due and store the verdict unless the step has one by
        then. Read after this caller's own verdicts committed, so the caller that stored a step's
        last verdict finds the step due; two callers that both do (a worker and a re-verification
        job, or two daemons on one root) store one verdict: ``StepJudge.check`` decides under the
        step's row lock."""
        if self.steps.ready(ckpt_id):
            self.steps.check(ckpt_id, unjudged_only=True)

    def check_step(self, ckpt_id: int) -> list[str]:
        """Run the step-level checks now and store the verdict (also used for re-verification)."""
        return self.steps.check(ckpt_id)


# --- the daemon's pool ---------------------------------------------------------------------------


class Verifier(ShardVerifier):
    """``ShardVerifier`` plus ``verify_workers`` threads working a queue keyed by checkpoint."""

    def __init__(self, rules: ShardRules, sessions: sessionmaker[Session], steps: StepJudge, nodes: NodeView,
                 index_cache: IndexCache | None = None, *, workers: int = 2,
                 on_verified: Callable[[list[int]], None] | None = None) -> None:
        super().__init__(rules, sessions, steps, nodes, index_cache, on_verified=on_verified)
        # checkpoint id -> {shard id: its ask (see submit)}; an empty entry asks for the step checks
        self.queue: KeyedQueue[int, int, datetime | None] = KeyedQueue(_BATCH, _earlier_ask)
        self._workers = [threading.Thread(target=self._work, name=f"ckptd-verify-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._workers:
            t.start()

    def submit(self, shard_ids: list[int], *, if_unverified: bool = False) -> None:
        """Queue shards for verification, each under its checkpoint (one query: which). A shard
        already queued merges with its entry, and one being verified is not queued again:
        MindSpore's chmod after the rename must not verify a file twice (a real change mid-read is
        detected by the verification itself, which then re-queues).

        ``if_unverified``: verify a shard only while it has no verdict under this daemon's
        configuration (ingest's new files, a rescan's re-queues; ``states.awaits_verification``).
        Decided under the checkpoint's lock, so a verdict another daemon on a shared root stored
        meanwhile is never repeated, however late the caller read the state.
        Otherwise (scrub, a changed sidecar): verify again, unless another daemon verifies it
        after this call."""
        if not shard_ids:
            return
        ask = None if if_unverified else datetime.now(timezone.utc)
        with self.sessions() as s:
            rows = verdicts.shard_checkpoints(s, shard_ids)
        by_ckpt: dict[int, dict[int, datetime | None]] = {}
        for ckpt_id, shard_id in rows:
            by_ckpt.setdefault(ckpt_id, {})[shard_id] = ask
        for ckpt_id, asks in by_ckpt.items():
            self.queue.add(ckpt_id, asks)

    def submit_step(self, ckpt_id: int) -> None:
        """Run the step's checks on a worker if they are due (after any of its shards queued now)."""
        self.queue.add(ckpt_id)

    def _work(self) -> None:
        while (taken := self.queue.take()) is not None:
            ckpt_id, asks = taken
            again: list[int] = []
            try:
                if asks:
                    again = [sid for sid, state in self.verify_shards(list(asks), asks).items() if state is None]
                else:
                    self.check_step_if_due(ckpt_id)
            except Exception:  # a bug must not kill a worker; the shards stay 'complete' and the next rescan re-queues them
                log.exception("verification of checkpoint %d (%d shards) failed unexpectedly", ckpt_id, len(asks))
            finally:
                self.queue.done(ckpt_id)
            if again:  # the file changed while we read it: verify the new version
                self.queue.add(ckpt_id, dict.fromkeys(again, datetime.now(timezone.utc)))

    def drain(self, timeout: float | None = None) -> None:
        if not self.queue.drain(timeout):
            raise TimeoutError("verification still running")

    def idle(self) -> bool:
        return self.queue.idle()

    def stalled(self, seconds: float) -> dict[str, float]:
        """Workers busy with one unit of work (a batch, a step check) for longer than ``seconds``:
        a hung file system or a bug; ``/healthz`` reports them."""
        now = time.monotonic()
        return {name: now - t for name, t in self.queue.busy().items() if now - t > seconds}

    def close(self) -> None:
        """Stop the workers; queued work is dropped (the next start's rescan re-queues it)."""
        self.queue.close()
        deadline = time.monotonic() + 10  # shutdown is bounded: a worker stuck in I/O is a daemon thread
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("verification worker %s did not stop in time; exiting without it", t.name)
