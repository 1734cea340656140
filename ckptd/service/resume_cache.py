"""The resume oracle's answer cache: pre-serialized answers, reused while the run's catalog is
unchanged (the generation counter of migration 0002), and the batched generation lookups of its
hit path. The answers themselves are :func:`ckptd.service.resume.resume`'s."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ckptd import runlayout
from ckptd.catalog import generations
from ckptd.catalog import nodes as node_registry
from ckptd.service.resume import ResumeOptions, resume

class _Batch:
    """Generation lookups waiting for the next round trip (see ResumeCache.current)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.done: asyncio.Future[dict[str, tuple] | None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task | None = None


class ResumeCache:
    """Pre-serialized resume answers, reused while the run's catalog is unchanged.

    A restart storm is hundreds of launchers asking the same question. Database triggers
    (migration 0002) bump ``resume_generations.generation`` of a run on every committed change
    that could alter its answer — states, marks, steps, strategies, shards, converted copies, a
    non-finite loss — whoever writes it (this daemon, the CLI, another daemon on the same
    PostgreSQL). A request reads that counter (one indexed point lookup) *after it arrived* and
    reuses the cached bytes only if it is unchanged, so a cached answer is never served after a
    change committed before the request arrived. Lease renewals do not bump it (they never change
    an answer); entries expire after ``ttl`` seconds so a polled answer still renews its lease.
    Answers that depend on the whole loss history (``skip_spikes``) are never cached.

    Hit path (:meth:`current`, on the event loop; no ORM session, no pool checkout): SQLite is
    read in-process with the loop thread's own DB-API connection (~20 us). PostgreSQL is a round
    trip, so requests share them: a lookup starts only after the previous one finished, and one
    lookup answers every request that arrived before it started (a storm shares a few round trips
    instead of making one per request, and the loop never blocks on the network). Anything unusual (a miss, a lookup
    error) returns None and the caller computes the answer with :meth:`answer` in an ORM session,
    which has the proper error handling.
    """

    def __init__(self, ttl: float = 300.0, max_entries: int = 4096) -> None:
        self.ttl, self.max_entries = ttl, max_entries
        self._lock = threading.Lock()
        self._entries: dict[tuple, tuple[tuple, float, bytes]] = {}
        self._local = threading.local()
        self._conns: list[Any] = []
        self._engine: Engine | None = None
        self._db_errors: tuple[type[BaseException], ...] = ()
        self._remote = False
        self._pending: _Batch | None = None
        self._in_flight: asyncio.Lock | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.hits = self.misses = 0

    def bind(self, engine: Engine) -> None:
        """The catalog the hit path reads generations from (set when the app starts)."""
        self._engine = engine
        self._db_errors = (engine.dialect.dbapi.Error,)
        self._remote = engine.dialect.name == "postgresql"
        if self._remote:  # one thread, so one connection, for the batched lookups
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckptd-resume-gen")

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._drop_connection_all()

    @staticmethod
    def generation(s: Session, run_name: str) -> tuple | None:
        """(run id, generation) of a run, None if there is no such run (inside an ORM session)."""
        return generations.of_run(s, run_name)

    # --- hit path --------------------------------------------------------------------------------

    def _entry(self, run_name: str, opts: ResumeOptions) -> tuple[tuple, float, bytes] | None:
        if opts.skip_spikes or self._engine is None:
            return None
        with self._lock:
            hit = self._entries.get((run_name, opts))
        return hit if hit is not None and time.monotonic() - hit[1] < self.ttl else None

    def _served(self, hit: tuple[tuple, float, bytes], gen: tuple | None) -> bytes | None:
        if gen is None or gen != hit[0]:
            return None
        with self._lock:
            self.hits += 1
        return hit[2]

    async def current(self, run_name: str, opts: ResumeOptions) -> bytes | None:
        """The cached answer if it is still current, else None (the caller computes it)."""
        hit = self._entry(run_name, opts)
        if hit is None:
            return None
        if not self._remote:
            return self.cached(run_name, opts)
        generations = await self._batched_lookup(run_name)
        return None if generations is None else self._served(hit, generations.get(run_name))

    def cached(self, run_name: str, opts: ResumeOptions) -> bytes | None:
        """:meth:`current` with a lookup on the caller's thread (blocking; fine for SQLite)."""
        hit = self._entry(run_name, opts)
        if hit is None:
            return None
        try:
            gen = self._lookup(run_name)
        except self._db_errors:  # a broken or busy connection: drop it, let the full path answer (and report)
            self._drop_connection()
            return None
        return self._served(hit, gen)

    async def _batched_lookup(self, run_name: str) -> dict[str, tuple] | None:
        batch = self._pending
        if batch is None:
            batch = self._pending = _Batch()
            batch.task = asyncio.get_running_loop().create_task(self._run_batch(batch))  # referenced: never collected
        batch.names.add(run_name)
        return await asyncio.shield(batch.done)  # a client hanging up must not cancel the others' lookup

    async def _run_batch(self, batch: _Batch) -> None:
        if self._in_flight is None:
            self._in_flight = asyncio.Lock()
        async with self._in_flight:
            self._pending = None  # closed: whoever arrives from now on waits for the next lookup
            try:
                found = await asyncio.get_running_loop().run_in_executor(self._executor, self._lookup_many, batch.names)
            except (*self._db_errors, RuntimeError):  # RuntimeError: executor shut down
                self._drop_connection_all()
                found = None
            batch.done.set_result(found)

    def _lookup_many(self, names: set[str]) -> dict[str, tuple]:
        return generations.lookup_many(self._connection(), names)

    def _connection(self) -> Any:
        """This thread's own DB-API connection for generation lookups, opened on first use."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            assert self._engine is not None, "ResumeCache.bind(engine) was not called"
            conn = generations.open_connection(self._engine, self._remote)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def _lookup(self, run_name: str) -> tuple | None:
        return generations.lookup(self._connection(), run_name, self._remote)

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            with contextlib.suppress(Exception):
                conn.close()

    def _drop_connection_all(self) -> None:
        """After a failed batched lookup: the next one reconnects (its thread finds no connection)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._local = threading.local()

    # --- miss path -------------------------------------------------------------------------------

    def answer(self, s: Session, run_name: str, opts: ResumeOptions) -> bytes:
        """The answer, computed in ``s`` and cached (raises, uncached, when nothing is restorable)."""
        if opts.skip_spikes:
            return json.dumps(resume(s, run_name, opts)).encode()
        gen = self.generation(s, run_name)  # read *before* computing: the body is never older than it
        now = time.monotonic()
        # liveness moves with time, not with catalog writes: an answer that could change when a
        # node falls silent is kept only until the first node could (a node coming back bumps
        # every run's generation when it registers)
        flip = node_registry.next_change(s, opts.node_timeout) if node_registry.several(s) else None
        doc = resume(s, run_name, opts)
        body = json.dumps(doc).encode()
        if runlayout.by_name(doc["layout"]).has_tracker:
            return body  # it reports the tracker file's state, which no catalog write announces
        if flip is not None:
            now -= max(0.0, self.ttl - max(0.0, (flip - datetime.now(UTC)).total_seconds()))
        with self._lock:
            self.misses += 1
            if gen is not None:
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
                self._entries[(run_name, opts)] = (gen, now, body)
        return body
