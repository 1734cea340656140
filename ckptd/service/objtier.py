"""The object tier's daemon side: verified steps copied to S3-compatible storage, committed by a manifest.

One thread per daemon (``ckptd-object``) runs :meth:`ObjectTier.run_once` in a loop:

1. upload: every ``upload_every``-th verified step's shards that *this node* owns (``shards.node``)
   go up as ``PREFIX/<run>/<step>/<run-relative path>``, each hashed while read (it must be the
   verified file: the catalog's xxh3-128) and read back from the server before its copy row is
   recorded ``complete``. Encrypted shards go up as they are (ckptd never decrypts to upload).
2. commit: the daemon whose row makes every expected rank ``complete`` (under the step's row lock:
   exactly one) uploads the strategy file, writes the manifest, and only then turns the rows
   ``verified``: from then on ``ls`` / the API list ``object`` and the oracle may answer from it.
3. scrub (``object_scrub_interval``): each verified object is read back again; one changed or gone
   becomes ``corrupt`` / ``deleted`` and the step is no longer answered from the tier.
4. retention (``object_keep_last`` / ``object_keep_every``): over the steps whole on the tier; a
   step's manifest is deleted first, then its objects. It reads every run on the tier, so it runs
   only on a pass after the tier changed (this daemon wrote a manifest or deleted a step), or
   ``object_gc_interval`` after the last run (another daemon's commits), not on every pass.

Failures never stop the file tier: an unreachable server is retried with back-off (1 s doubling
to 60 s; nothing is committed until everything is up); wrong credentials or a missing bucket are
one clear error in the log and in ``/healthz``'s details (:attr:`ObjectTier.problem`), retried slowly.
A shard whose object reads back differently from its verified digest (the file changed since it was
verified, or the upload was torn), or whose file cannot be opened, is not recorded: it is handed back
to the verifier (``requeue``) and not tried again for 30 s, doubling to 1 h, for as long as its
verified digest stays the same, so one bad file is never re-uploaded on every pass.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.catalog import copies, objrows
from ckptd.errors import CkptdError
from ckptd.policy import RetentionPolicy
from ckptd.service.resume import step_infos
from ckptd.service.verifier import file_digest
from ckptd.states import ShardState, StepState, Tier
from ckptd.storage import PosixStorage, objmanifest
from ckptd.storage.s3 import ObjectStore, ObjectStoreError

log = logging.getLogger("ckptd.objtier")

MAX_BACKOFF = 60.0
#: a shard refused at read-back waits this long before its next upload, doubling up to REFUSED_MAX
REFUSED_BACKOFF = 30.0
REFUSED_MAX = 3600.0


class ObjectTier:
    def __init__(self, sessions: sessionmaker[Session], files: PosixStorage, objects: ObjectStore, node: str, *,
                 upload_every: int = 1, scrub_interval: float = 0.0, policy: RetentionPolicy | None = None,
                 gc_interval: float = 300.0, requeue: Callable[[list[int]], None] | None = None,
                 on_commit: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sessions = sessions
        self.files = files
        self.objects = objects
        self.node = node
        self.upload_every = max(1, upload_every)
        self.scrub_interval = scrub_interval
        self.policy = policy
        self.gc_interval = gc_interval
        self._tier_changed = True  # a new daemon has not seen the tier: its first pass runs retention
        self._last_gc = 0.0
        #: hands shard ids back to the verifier (the daemon's ``Verifier.submit``): a file that no
        #: longer reads as verified is the verifier's to re-judge, not the object tier's
        self.requeue = requeue
        self.clock = clock
        #: shard id -> (verified digest, back-off seconds, retry at): refused shards not tried again yet
        self._refused: dict[int, tuple[str | None, float, float]] = {}
        self.passes = 0
        self.shard_attempts = 0
        self.shard_failures = 0
        self.gc_runs = 0
        #: what is wrong with the tier now (``/healthz`` details), None when it works
        self.problem: dict[str, str] | None = None
        self._backoff = 1.0
        self.uploaded_bytes = 0
        self.upload_seconds = 0.0
        #: told the seconds from a step's files verified to its manifest written (the daemon's
        #: histogram); the newest one is in :meth:`status`
        self.on_commit = on_commit
        self.last_commit_delay: float | None = None

    # --- the loop ------------------------------------------------------------------------------

    def run_once(self) -> float:
        """One pass; returns how long to wait before the next."""
        self.passes += 1
        try:
            if self.problem is not None:
                self.objects.check_access()  # the cheapest way to learn the server is back
            self.upload_due()
            self.commit_pending()
            if self.scrub_interval:
                self.scrub()
            if self.policy is not None and (self._tier_changed or self.clock() - self._last_gc >= self.gc_interval):
                self.gc()  # cleared after (one thread commits and deletes): a failed run is tried again
                self._tier_changed = False
                self._last_gc = self.clock()
                self.gc_runs += 1
        except ObjectStoreError as err:
            self._failed(err)
            wait, self._backoff = self._backoff, min(self._backoff * 2, MAX_BACKOFF)
            return MAX_BACKOFF if err.kind in ("credentials", "bucket") else wait
        if self.problem is not None:
            log.info("object tier %s works again", self.objects.url)
        self.problem = None
        self._backoff = 1.0
        return 0.5

    def _failed(self, err: ObjectStoreError) -> None:
        problem = {"kind": err.kind, "error": err.message, "store": str(self.objects.url)}
        if problem != self.problem:  # one line per new problem, not one per retry
            if err.kind in ("credentials", "bucket"):
                log.error("object tier disabled until fixed: %s (the file tier keeps serving)", err.message)
            else:
                log.warning("object tier: %s; retrying with back-off", err.message)
        self.problem = problem

    # --- upload and commit ---------------------------------------------------------------------

    def upload_due(self) -> int:
        now = self.clock()
        held = {sid: digest for sid, (digest, _delay, at) in self._refused.items() if at > now}
        with self.sessions() as s:
            due = objrows.to_upload(s, self.node, self.upload_every, skip=held)
        n = 0
        for st in due:  # shards refused lately with the same verdict are not among them (``skip``)
            for sid, rank, path, size, digest in st.shards:
                self.shard_attempts += 1
                if self._upload_shard(st, rank, path, size, digest):
                    self._refused.pop(sid, None)
                    n += 1
                else:
                    self._refuse(sid, digest)
        return n

    def _refuse(self, sid: int, digest: str | None) -> None:
        """The shard was not recorded: back off (per shard and verified digest; a new verdict starts
        over) and let the verifier re-judge the file."""
        self.shard_failures += 1
        held = self._refused.get(sid)
        delay = min(held[1] * 2, REFUSED_MAX) if held is not None and held[0] == digest else REFUSED_BACKOFF
        self._refused[sid] = (digest, delay, self.clock() + delay)
        if self.requeue is not None:
            self.requeue([sid])

    def _key(self, run: str, step: int, incarnation: int | None, run_path: str, path: str) -> str:
        return f"{objmanifest.step_dir(run, step, incarnation)}/{os.path.relpath(path, run_path)}"

    def _upload_shard(self, st: objrows.StepToUpload, rank: int, path: str, size: int, digest: str | None) -> int:
        with self.sessions() as s:
            ident = objrows.identity(s, st.ckpt_id)
        key = self._key(st.run, st.step, ident.incarnation, st.run_path, path)
        t = time.perf_counter()
        # before the shard: once its row says complete, the committer may list the step's strategy objects
        self._upload_rank_strategy(ident, rank)
        try:
            with self.files.opened(path) as fd_path:
                sent = self.objects.put_file(key, fd_path)
        except ObjectStoreError:  # the server's fault, not the file's: the pass backs off as a whole
            raise
        except (CkptdError, OSError) as exc:  # gone, replaced, or refused by confinement: the verifier judges it
            log.info("object tier: %s not uploaded: %s", path, exc)
            return 0
        got = self.objects.digest(key, size)  # the read-back: what the server holds
        if got != digest or sent != size:
            # the file changed since it was verified (the verifier re-judges it), or the upload was torn
            log.warning("object tier: %s: the object read back is not the verified file; not recorded", path)
            self.objects.delete(key)
            return 0
        self.uploaded_bytes += size
        self.upload_seconds += time.perf_counter() - t
        with self.sessions.begin() as s:
            due = objrows.record_uploaded(s, st.ckpt_id, rank, self.objects.uri(key), size, got, self.node)
        if due:
            self.commit(st.ckpt_id)
        return 1

    def commit_pending(self) -> None:
        """Manifests a crash (or a server that went away) left unwritten after every object was up."""
        with self.sessions() as s:
            pending = objrows.uncommitted(s, self.node)
        for ckpt_id in pending:
            self.commit(ckpt_id)

    def commit(self, ckpt_id: int) -> None:
        """Write the step's manifest (after the strategy file), then mark its object copies verified."""
        with self.sessions() as s:
            ident = objrows.identity(s, ckpt_id)
            rows = objrows.object_rows(s, ckpt_id)
            verified_at = objrows.files_verified_at(s, ckpt_id)
        base = objmanifest.step_dir(ident.run, ident.step, ident.incarnation)
        objects = [{"path": self.objects.key_of(loc)[len(base) + 1:], "rank": rank, "role": "shard", "size": size,
                    "xxh3_128": digest} for rank, loc, size, digest, _ in rows]
        if per_rank_strategies(ident):
            objects += self._rank_strategy_objects(ident, base)
        elif ident.strategy_path and self.files.stat(ident.strategy_path) is not None:
            rel = os.path.relpath(ident.strategy_path, ident.run_path)
            try:
                size, digest = self._put_checked(f"{base}/{rel}", ident.strategy_path)
                objects.append({"path": rel, "rank": None, "role": "strategy", "size": size, "xxh3_128": digest})
            except ObjectStoreError:
                raise
            except (CkptdError, OSError) as exc:  # gone, unreadable, or replaced by a link or a directory: say so
                log.warning("object tier: strategy file %s not uploaded with step %d: %s", ident.strategy_path,
                            ident.step, exc)
        identity = {"prefix": ident.prefix, "epoch": ident.epoch, "name_step": ident.name_step, "step": ident.step,
                    "global_step": ident.global_step, "incarnation": ident.incarnation, "world_size": ident.world_size}
        body = objmanifest.encode(ident.run, identity, ident.layout, ident.strategy_hash, objects)
        self.objects.put_bytes(objmanifest.manifest_key(ident.run, ident.step, ident.incarnation), body)
        with self.sessions.begin() as s:
            objrows.commit(s, ckpt_id)
        self._tier_changed = True
        if verified_at is not None:
            self.last_commit_delay = max(0.0, (datetime.now(timezone.utc) - verified_at).total_seconds())
            if self.on_commit is not None:
                self.on_commit(self.last_commit_delay)
        log.info("object tier: run %s step %d committed (%d objects)", ident.run, ident.step, len(objects))

    def _put_checked(self, key: str, path: str) -> tuple[int, str]:
        """Upload the file at ``path`` (confined) as ``key`` and prove it by a read-back: (size, digest)."""
        with self.files.opened(path) as fd_path:
            size = self.objects.put_file(key, fd_path)
            digest = file_digest(fd_path)
        if self.objects.digest(key, size) != digest:
            raise ObjectStoreError(f"the object {key!r} reads back differently from {path}", kind="other")
        return size, digest

    def _upload_rank_strategy(self, ident: objrows.StepIdentity, rank: int) -> None:
        """MindFormers' per-rank strategy file of ``rank`` (``strategy/<base>_rank_<r>.ckpt``), uploaded
        by the daemon uploading that rank's shard: on node-local disks no other daemon sees it."""
        if not per_rank_strategies(ident):
            return
        directory = runlayout.rank_strategies_dir(ident.run_path)
        base = objmanifest.step_dir(ident.run, ident.step, ident.incarnation)
        try:
            names = [n for n in self.files.list(directory) if runlayout.rank_strategy_rank(n) == rank]
        except (CkptdError, OSError) as exc:
            log.warning("object tier: no strategy file of rank %d uploaded with step %d: %s", rank, ident.step, exc)
            return
        for name in names:
            try:
                self._put_checked(f"{base}/{runlayout.STRATEGY_DIR}/{name}", os.path.join(directory, name))
            except ObjectStoreError:
                raise
            except (CkptdError, OSError) as exc:
                log.warning("object tier: strategy file %s not uploaded with step %d: %s", name, ident.step, exc)

    def _rank_strategy_objects(self, ident: objrows.StepIdentity, base: str) -> list[dict[str, Any]]:
        """The manifest's entries of the per-rank strategy files the step's uploaders put up (each
        read back again here: the manifest names what the tier holds)."""
        prefix = f"{base}/{runlayout.STRATEGY_DIR}/"
        out = []
        for key, size in self.objects.list(prefix):
            name = key[len(prefix):]
            rank = runlayout.rank_strategy_rank(name)
            if rank is None or "/" in name:
                continue
            out.append({"path": f"{runlayout.STRATEGY_DIR}/{name}", "rank": rank, "role": "strategy", "size": size,
                        "xxh3_128": self.objects.digest(key, size)})
        missing = sorted(set(range(ident.world_size or 0)) - {o["rank"] for o in out})
        if missing:  # the step stays restorable; its strategy is then checked from what the fetch brings
            log.warning("object tier: run %s step %d has no per-rank strategy file of rank(s) %s on the tier",
                        ident.run, ident.step, missing)
        return out

    # --- scrub and retention -------------------------------------------------------------------

    def scrub(self, limit: int = 8) -> int:
        """Read back the objects verified longest ago; a changed or missing one loses its verdict."""
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=self.scrub_interval)
        with self.sessions() as s:
            due = objrows.due_for_scrub(s, self.node, cutoff, limit)
        for ckpt_id, rank, loc, size, digest in due:
            key = self.objects.key_of(loc)
            try:
                got = self.objects.digest(key, size)
            except ObjectStoreError as err:
                if err.kind != "not_found":
                    raise
                state, why = ShardState.DELETED, "the object is gone"
            else:
                state, why = (ShardState.VERIFIED, None) if got == digest else (
                    ShardState.CORRUPT, f"the object changed since upload (xxh3-128 {got[:12]}…, expected {digest[:12]}…)")
            if why:
                log.warning("object tier scrub: %s: %s", loc, why)
            with self.sessions.begin() as s:
                objrows.set_verdict(s, ckpt_id, loc, state, why)
        return len(due)

    def gc(self) -> int:
        """Object retention: over each run's steps whole on the tier (as the file policy sees steps)."""
        deleted = 0
        with self.sessions() as s:
            runs = objrows.runs_on_tier(s)
        for run_id, _name in runs:
            with self.sessions() as s:
                whole = copies.whole_steps(s, run_id, Tier.OBJECT, set())
                infos = [i for i in step_infos(s, run_id, datetime.now(timezone.utc)) if i.id in whole]
            from dataclasses import replace

            plan = self.policy.plan([replace(i, state=StepState.VERIFIED.value) for i in infos])
            for ckpt_id in plan.delete:
                self.delete_step(ckpt_id)
                deleted += 1
        return deleted

    def delete_step(self, ckpt_id: int) -> None:
        """The manifest first (the step leaves the tier at once), then its objects, then the rows."""
        with self.sessions() as s:
            ident = objrows.identity(s, ckpt_id)
        base = objmanifest.step_dir(ident.run, ident.step, ident.incarnation)
        with self.sessions.begin() as s:  # not answered from the tier any more, before any object goes
            objrows.set_verdict_all(s, ckpt_id, ShardState.DELETED, objrows.RETIRED)
        self.objects.delete(objmanifest.manifest_key(ident.run, ident.step, ident.incarnation))
        for key, _size in self.objects.list(base + "/"):
            self.objects.delete(key)
        with self.sessions.begin() as s:
            objrows.drop_step(s, ckpt_id)
        self._tier_changed = True
        log.info("object retention: run %s step %d deleted from %s", ident.run, ident.step, self.objects.url)

    def status(self) -> dict[str, Any]:
        return {"store": str(self.objects.url), "problem": self.problem, "passes": self.passes,
                "shard_attempts": self.shard_attempts, "shard_failures": self.shard_failures, "gc_runs": self.gc_runs,
                "uploaded_bytes": self.uploaded_bytes, "upload_seconds": round(self.upload_seconds, 3),
                "last_manifest_delay_seconds": self.last_commit_delay}


def per_rank_strategies(ident: objrows.StepIdentity) -> bool:
    """The step is bound to the merge of per-rank strategy files (MindFormers' ``strategy/``)."""
    return ident.strategy_path is not None and \
        ident.strategy_path == runlayout.rank_strategies_dir(ident.run_path)

