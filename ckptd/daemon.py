"""Composition root: settings → catalog → verifier → ingestor → watcher, and the job runner.

``Daemon(settings).start()`` refuses to run on a catalog whose schema is not exactly this ckptd's
(``ckptd db upgrade`` first). ``stop()`` stops jobs (bounded) and events, then drains verification.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from sqlalchemy.orm import sessionmaker

from ckptd.catalog import nodes as node_registry
from ckptd.catalog.db import make_engine, require_current_schema
from ckptd.catalog.nodes import NodeView
from ckptd.errors import CkptdError
from ckptd.format.index_cache import IndexCache
from ckptd.policy import RetentionPolicy
from ckptd.service.ingest import Ingestor
from ckptd.service.jobrunner import JobRunner
from ckptd.service.jobs import recover_abandoned
from ckptd.service.metrics import DaemonMetrics, Tallies
from ckptd.service.retention import finish_pending, gc
from ckptd.service.stepcheck import ReplicaCheck
from ckptd.service.stepjudge import StepJudge
from ckptd.service.verifier import ShardRules, ShardVerifier, Verifier
from ckptd.settings import Settings
from ckptd.watcher import Watcher

log = logging.getLogger("ckptd.daemon")


def shard_rules(settings: Settings) -> ShardRules:
    """What every verdict of this configuration depends on: the confined root, the key, the CRC
    and encryption policies, and their stamp."""
    return ShardRules(settings.storage, settings.encryption_key(), settings.require_crc, settings.require_encryption,
                      settings.verification_stamp())


def verifier(settings: Settings, sessions: sessionmaker, nodes: NodeView, index_cache: IndexCache | None = None,
             *, pool: bool = True, on_verified: Callable[[list[int]], None] | None = None) -> ShardVerifier:
    """The daemon's verifier (``pool``: ``verify_workers`` threads), or one that verifies on the
    caller's thread (``ckptd verify --run``), with the step checks of this configuration
    (``on_verified``: see ``ShardVerifier``)."""
    rules = shard_rules(settings)
    steps = StepJudge(rules.store, sessions, rules.key, ReplicaCheck(settings.replica_check, settings.replica_sample),
                      index_cache)
    if pool:
        return Verifier(rules, sessions, steps, nodes, index_cache, workers=settings.verify_workers,
                        on_verified=on_verified)
    return ShardVerifier(rules, sessions, steps, nodes, index_cache, on_verified=on_verified)


def ingestor(settings: Settings, sessions: sessionmaker, nodes: NodeView, submit: Callable[..., None],
             submit_step: Callable[[int], None], index_cache: IndexCache | None = None) -> Ingestor:
    return Ingestor(shard_rules(settings), sessions, submit, submit_step, nodes, settle_seconds=settings.settle_seconds,
                    world_size=settings.world_size, index_cache=index_cache)


def object_tier(settings: Settings, sessions: sessionmaker,  # noqa: ANN201 - ckptd.service.objtier.ObjectTier
                requeue: Callable[[list[int]], None] | None = None,
                on_commit: Callable[[float], None] | None = None):
    """The object tier of this configuration (its client library loads on first use)."""
    from ckptd.service.objtier import ObjectTier
    from ckptd.storage.s3 import ObjectStore

    policy = None
    if settings.object_keep_last or settings.object_keep_every:
        policy = RetentionPolicy(keep_last=settings.object_keep_last, keep_every=settings.object_keep_every)
    return ObjectTier(sessions, settings.storage, ObjectStore(settings.object_store), settings.node_name,
                      upload_every=settings.upload_every, scrub_interval=settings.object_scrub_interval, policy=policy,
                      gc_interval=settings.object_gc_interval, requeue=requeue, on_commit=on_commit)


class Daemon:
    def __init__(self, settings: Settings) -> None:
        if not os.path.isdir(settings.root):
            raise CkptdError("checkpoint root is not a directory", path=str(settings.root), hint="create it or pass --root")
        self.settings = settings
        self.store = settings.storage
        self.engine = make_engine(settings.db)
        require_current_schema(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        index_cache = IndexCache()  # a new shard is opened by ingest, verification and step checks
        self.nodes = NodeView(self.sessions, settings.node_name, settings.node_timeout, root=str(settings.root))
        # /metrics: this daemon's registry; the verifier and the resume route observe latencies on it
        self.metrics = DaemonMetrics(self.sessions, node=settings.node_name, node_timeout=settings.node_timeout,
                                     tallies=self.tallies)
        self.verifier: Verifier = verifier(settings, self.sessions, self.nodes, index_cache,  # type: ignore[assignment]
                                           on_verified=self.metrics.shards_verified)
        self.ingestor = ingestor(settings, self.sessions, self.nodes, self.verifier.submit, self.verifier.submit_step,
                                 index_cache)
        self._stopping = threading.Event()
        self.memory = None  # the memory tier's owner, once started with memory_root set
        self.objects = None  # the object tier's owner, once started with object_store set
        # conversions run as API jobs on worker threads; /metrics reports their throughput
        self._conversion_lock = threading.Lock()
        self.conversion_bytes = 0
        self.conversion_seconds = 0.0
        self.watcher = Watcher(
            self.ingestor,
            debounce=settings.debounce,
            rescan_interval=settings.rescan_interval,
            settle_seconds=settings.settle_seconds,
            backend=settings.watch_backend,
        )
        # re-verification and conversions the API starts
        self.jobs = JobRunner(self.sessions, self.ingestor.examine_many, self.verifier.verify_shards,
                              self.verifier.check_step, owner=self.nodes.owner, node=settings.node_name)

    def record_conversion(self, nbytes: int, seconds: float) -> None:
        """A conversion finished here: ``nbytes`` written (and verified) in ``seconds``."""
        with self._conversion_lock:
            self.conversion_bytes += nbytes
            self.conversion_seconds += seconds

    def tallies(self) -> Tallies:
        """This process's counts since start, as ``/metrics`` reports them."""
        v = self.verifier
        with self._conversion_lock:
            converted = (self.conversion_bytes, self.conversion_seconds)
        m = self.memory
        memory = (m.snapshots, m.persisted, m.bytes_hashed) if m is not None else (0, 0, 0)
        return Tallies(v.verified_count, v.failed_count, v.verified_bytes, v.verify_seconds, self.watcher.rescans,
                       self.watcher.events_lost, *converted, *memory)

    def start(self) -> None:
        log.info("watching %s as node %s (catalog %s)", self.settings.root, self.settings.node_name,
                 self.engine.url.render_as_string(hide_password=True))
        with self.sessions.begin() as s:
            node_registry.register(s, self.settings.node_name, str(self.settings.root))
        node_registry.write_marker(str(self.settings.root), self.settings.node_name)  # who shares this root
        finished = finish_pending(self.sessions, self.store, owner=self.nodes.owner())  # a gc a crash interrupted
        if finished:
            log.info("finished %d interrupted retention deletions", finished)
        recovered = recover_abandoned(self.sessions, self.store, timeout=self.settings.node_timeout)
        if recovered["jobs"] or recovered["conversions"]:
            log.warning("failed %d jobs and %d conversions left by dead processes; removed %s",
                        len(recovered["jobs"]), len(recovered["conversions"]), recovered["removed"])
        threading.Thread(target=self._heartbeat_loop, name="ckptd-heartbeat", daemon=True).start()
        self.watcher.start()
        if self.settings.scrub_interval:
            threading.Thread(target=self._scrub_loop, name="ckptd-scrub", daemon=True).start()
        if self.settings.memory_root is not None:
            from ckptd.service.memtier import MemoryTier

            self.memory = MemoryTier(self.sessions, self.store, str(self.settings.memory_root), self.settings.node_name,
                                     persist_every=self.settings.persist_every, key=self.settings.encryption_key(),
                                     release_after=self.settings.memory_release_after,
                                     scrub_after=self.settings.memory_scrub_after)
            self.memory.reconcile()
            threading.Thread(target=self._memory_loop, name="ckptd-memory", daemon=True).start()
        if self.settings.object_store is not None:
            self.objects = object_tier(self.settings, self.sessions, self.verifier.submit, self.metrics.manifest_written)
            threading.Thread(target=self._object_loop, name="ckptd-object", daemon=True).start()
        if self.settings.gc_keep_last or self.settings.gc_keep_every:
            self._gc_thread = threading.Thread(target=self._gc_loop, name="ckptd-gc", daemon=True)
            self._gc_thread.start()

    def _heartbeat_loop(self) -> None:
        """Tell the other daemons this node is alive (and whoever looks in the root: the marker is
        written again if the root was wiped), and do this node's part of deletions that another
        node's gc started (each node deletes only its own files)."""
        while not self._stopping.wait(self.settings.heartbeat_interval):
            try:
                with self.sessions.begin() as s:
                    node_registry.heartbeat(s, self.settings.node_name)
                node_registry.renew_marker(str(self.settings.root), self.settings.node_name)
                finish_pending(self.sessions, self.store, owner=self.nodes.owner())
                # a job of another node's dead process shows up only after node_timeout
                recover_abandoned(self.sessions, self.store, timeout=self.settings.node_timeout,
                                  at_start=False)
            except Exception:
                log.exception("heartbeat failed; will retry")

    def _scrub_loop(self) -> None:
        """Background re-verification at the lowest priority: a few shards at a time, and only
        while the verifier has nothing else to do, so fresh shards never queue behind a scrub."""
        idle_period = min(60.0, self.settings.scrub_interval)
        chunk = 4 * self.settings.verify_workers
        period = idle_period
        while not self._stopping.wait(period):
            try:
                if not self.verifier.idle():
                    period = 1.0
                    continue
                due = self.verifier.due_for_scrub(self.settings.scrub_interval, chunk)
                self.verifier.submit(due)
                period = 1.0 if due else idle_period
            except Exception:
                log.exception("background scrub failed; will retry")
                period = idle_period

    def _memory_loop(self) -> None:
        """The memory tier of this node: one thread owns its slots (ckptd.service.memtier)."""
        # commit words are polled only while some job has slots here: an idle daemon wakes once a
        # second (a poll every 20 ms costs the API's event loop GIL hand-offs for nothing)
        while True:
            self.memory.wake.wait(self.settings.memory_scan_interval if not self.memory.idle else 1.0)
            self.memory.wake.clear()
            if self._stopping.is_set():
                return
            try:
                self.memory.scan()
            except Exception:
                log.exception("memory tier scan failed; will retry")

    def _object_loop(self) -> None:
        """The object tier of this node: uploads, commits, scrub, retention (ckptd.service.objtier);
        its failures back off here and never reach the file tier."""
        wait = 0.0
        while not self._stopping.wait(wait):
            try:
                wait = self.objects.run_once()
            except Exception:
                log.exception("object tier pass failed; will retry")
                wait = 30.0

    def _gc_loop(self) -> None:
        policy = RetentionPolicy(keep_last=self.settings.gc_keep_last or None, keep_every=self.settings.gc_keep_every)
        while not self._stopping.wait(self.settings.gc_interval):
            try:
                report = gc(self.sessions, self.store, policy, owner=self.nodes.owner(),
                            torn_grace=self.settings.gc_torn_grace)
                if report.deleted_steps or report.refused or report.torn_temps:
                    log.info("retention: deleted %d steps (%d files), %d torn temp files; refused: %s",
                             report.deleted_steps, report.deleted_files, len(report.torn_temps), report.refused)
            except Exception:
                log.exception("background retention failed; will retry")

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until events, ingest and verification are all quiet (seen twice in a row)."""
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline:
            quiet = quiet + 1 if self.watcher.idle() and self.verifier.idle() else 0
            if quiet >= 2:
                return True
            time.sleep(0.05)
        return False

    def stalls(self) -> dict[str, float]:
        """Threads that made no progress for ``worker_stall_seconds``: name -> seconds busy."""
        limit = self.settings.worker_stall_seconds
        out = self.verifier.stalled(limit) | self.jobs.stalled(limit)
        since = self.watcher.busy_since
        if since is not None and time.monotonic() - since > limit:
            out["ckptd-ingest"] = time.monotonic() - since
        return out

    def stop(self) -> None:
        self._stopping.set()
        if self.memory is not None:
            self.memory.wake.set()
        self.jobs.close()
        self.watcher.stop()
        try:
            self.verifier.drain(timeout=60)
        except TimeoutError:
            log.warning("stopping with verification still queued; the next start re-queues it")
        self.verifier.close()
        self.engine.dispose()
