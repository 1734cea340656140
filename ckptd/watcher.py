"""File events → debounced ``Ingestor.examine`` calls, plus the periodic full rescan.

Events come from an *event source*: ckptd's lean inotify reader on Linux (``ckptd.inotify``) or
a watchdog observer (elsewhere, or ``watch_backend = "watchdog"``). Both only say "look at this
path"; what a path is and whether it changed is decided by ingest.

One ingest thread does all catalog writes of this daemon (events and rescans are serialized), so
ordering questions never arise inside a daemon; across daemons the catalog's constraints decide.
Events are hints: a lost or reordered event is repaired by the next rescan.
"""

from __future__ import annotations

import heapq
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Literal, Protocol

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from ckptd import runlayout
from ckptd.service.ingest import Ingestor

log = logging.getLogger("ckptd.watcher")

# What can change the catalog: a file appearing (create, the rename that commits a save), its
# write finishing (close after writing) and files or directories going away. Not modifications:
# every write() of a multi-GB save would be an event, and in watchdog "modified" also means
# attribute changes, so it cannot be asked for without them. MindSpore's chmod 0400 follows its
# rename at once; a file still writable when examined is re-examined after settle_seconds.
_WANTED = [FileCreatedEvent, FileMovedEvent, FileDeletedEvent, FileClosedEvent, DirCreatedEvent, DirMovedEvent,
           DirDeletedEvent]


def wanted_name(name: str) -> bool:
    """Event filter on a file's base name: a save in flight (``*.tmp``) or a hidden file is never
    a shard, so its create / close / rename-away events are not worth an examination each."""
    return not runlayout.is_in_flight(name) and not name.startswith(".")


class _EventSource(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


class _Handler(FileSystemEventHandler):
    def __init__(self, poke: Callable[[str], None]) -> None:
        self.poke = poke

    # Only changes matter. Opens and read-only closes are excluded on purpose: ckptd's own reads
    # (verification) would otherwise re-trigger examination forever.
    RELEVANT = frozenset({"created", "modified", "moved", "deleted", "closed"})

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in self.RELEVANT or (event.is_directory and event.event_type != "moved"):
            return
        for path in (str(event.src_path), str(getattr(event, "dest_path", "") or "")):
            if not path or not wanted_name(path.rpartition("/")[2]):
                continue
            self.poke(path)  # dest_path: MindSpore's tmp -> final rename, the commit point


class _WatchdogSource:
    """The portable event source: a watchdog observer on the root."""

    def __init__(self, root: str, poke: Callable[[str], None]) -> None:
        self.observer = Observer()
        # The kernel is asked only for _WANTED: opens, reads and read-only closes (ckptd's own
        # verification makes several per shard) and per-write modifications never reach Python.
        self.observer.schedule(_Handler(poke), root, recursive=True, event_filter=_WANTED)
        self.observer.daemon = True

    def start(self) -> None:
        # watchdog warns each time a directory is created inside the watched tree; it is harmless
        # and would otherwise flood the daemon's log during every save
        warnings.filterwarnings("ignore", message="Callback with id", category=RuntimeWarning)
        self.observer.start()

    def stop(self) -> None:
        self.observer.stop()
        self.observer.join(timeout=5)


class _InotifySource:
    def __init__(self, root: str, watcher: "Watcher") -> None:
        from ckptd.inotify import InotifyTree

        self.tree = InotifyTree(root, watcher.poke_many, watcher.lost_events, wanted=wanted_name)

    def start(self) -> None:
        self.tree.open()
        self.tree.start()

    def stop(self) -> None:
        self.tree.close()


def resolve_backend(backend: str) -> str:
    """``auto`` → ``inotify`` where the kernel has it (Linux), else ``watchdog``."""
    if backend != "auto":
        return backend
    from ckptd import inotify

    return "inotify" if sys.platform.startswith("linux") and inotify.available() else "watchdog"


def _event_source(backend: str, root: str, watcher: "Watcher") -> _EventSource:
    return _InotifySource(root, watcher) if backend == "inotify" else _WatchdogSource(root, watcher.poke)


class Watcher:
    """Call order: ``start()`` (initial rescan happens on the ingest thread) → ``stop()``."""

    def __init__(
        self, ingestor: Ingestor, *, debounce: float, rescan_interval: float, settle_seconds: float,
        backend: Literal["auto", "inotify", "watchdog"] = "auto",
    ) -> None:
        self.ingestor = ingestor
        self.backend = resolve_backend(backend)  # what runs, for /healthz
        self.debounce = debounce
        self.rescan_interval = rescan_interval
        self.settle_seconds = settle_seconds
        self._due: list[tuple[float, str]] = []
        self._pending: dict[str, float] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._source: _EventSource | None = None
        self._thread = threading.Thread(target=self._loop, name="ckptd-ingest", daemon=True)
        self.rescans = 0
        self.events_lost = 0  # times the event source may have missed changes (each one asks for a rescan)
        self._busy = False
        self.busy_since: float | None = None  # when the ingest thread began its current batch (/healthz)
        self._rescan_now = False
        self.ready = threading.Event()  # set after the first full rescan
        # what the settled barrier (ckptd.service.settled) reads: rescans by the order they started,
        # the newest that finished without an error, and the paths being examined right now
        self._rescan_seq = 0
        self._rescan_ok = 0
        self._in_hand: list[str] = []

    def poke(self, path: str, delay: float | None = None) -> None:
        self.poke_many([path], delay)

    def poke_many(self, paths: list[str], delay: float | None = None) -> None:
        """Examine ``paths`` after ``delay`` (default: the debounce); one event read's worth (a
        step's burst of renames) takes the lock once."""
        due = time.monotonic() + (self.debounce if delay is None else delay)
        with self._cond:
            for path in paths:
                # debounce: a burst of events for one path collapses into one examination
                if path in self._pending and self._pending[path] <= due:
                    continue
                self._pending[path] = due
                heapq.heappush(self._due, (due, path))
            self._cond.notify()

    def lost_events(self, why: str) -> None:
        """The event source may have missed changes: reconcile with a full rescan (the truth)."""
        log.warning("file events may have been lost (%s); rescanning", why)
        self.events_lost += 1
        self.poke_rescan()

    def poke_rescan(self) -> None:
        """Run a full rescan on the ingest thread now (on-demand reconciliation)."""
        self.rescan_fence()

    def idle(self) -> bool:
        """No event waiting and nothing being examined right now (for tests and graceful stops)."""
        with self._cond:
            return not self._due and not self._busy

    def rescan_fence(self) -> int:
        """Ask for a full rescan now; :meth:`rescanned_since` of the number returned is true once a
        rescan that *started* after this call finished without an error -- every file on disk by
        now was then examined (or, still being written, put back in :meth:`examining`)."""
        with self._cond:  # one hold: the rescan asked for cannot start between the request and the count
            self._rescan_now = True
            self._busy = True  # counts as work until the loop picks it up
            self._cond.notify()
            return self._rescan_seq + 1  # the next rescan to start; the one running (if any) started before

    def rescanned_since(self, fence: int) -> bool:
        with self._cond:
            return self._rescan_ok >= fence

    def examining(self, prefix: str) -> int:
        """Paths at or below ``prefix`` waiting for their examination or being examined right now."""
        below = prefix.rstrip("/") + "/"
        with self._cond:
            return sum(1 for p in (*self._pending, *self._in_hand) if p.startswith(below) or p == below[:-1])

    def start(self) -> None:
        # Events first, then the ingest thread's initial rescan: a file written in between is
        # seen by one or the other (or both; examination is idempotent).
        source = _event_source(self.backend, self.ingestor.root, self)
        source.start()
        self._source = source
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._source is not None:
            self._source.stop()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        next_rescan = time.monotonic()
        while True:
            with self._cond:
                if self._stop:
                    return
                now = time.monotonic()
                wait = 0.0 if self._rescan_now else next_rescan - now
                if self._due:
                    wait = min(wait, self._due[0][0] - now)
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                batch: list[str] = []
                while self._due and self._due[0][0] <= now:
                    due, path = heapq.heappop(self._due)
                    if self._pending.get(path) == due:
                        del self._pending[path]
                        batch.append(path)
                rescan = next_rescan <= now or self._rescan_now
                self._rescan_now = False
                self._busy = True  # set under the lock: idle() never sees popped-but-unprocessed work
                self.busy_since = time.monotonic()
                self._in_hand = batch  # likewise for examining(): a popped path is still being examined
                if rescan:
                    self._rescan_seq += 1
                    seq = self._rescan_seq
            try:
                if rescan:
                    if self._safe(self._rescan):
                        with self._cond:
                            self._rescan_ok = seq  # after its unsettled paths were put back in _pending
                    next_rescan = time.monotonic() + self.rescan_interval
                if batch:
                    self._examine(batch)
            finally:
                with self._cond:
                    self._busy = self._rescan_now
                    self.busy_since = None
                    self._in_hand = []

    def _rescan(self) -> None:
        report = self.ingestor.rescan(should_stop=lambda: self._stop)
        self.rescans += 1
        self.ready.set()
        for path in report.unsettled:
            self.poke(path, self.settle_seconds)
        log.info("rescan: %d shards, %d new, %d deleted", report.shards_seen, report.shards_new, report.shards_deleted)

    def _examine(self, paths: list[str]) -> None:
        """One batch of due paths (a step's burst of renames lands in few batches). Should the
        batch fail, each path is retried alone so one bad file cannot hold back the others."""
        if self._stop:
            return
        t0 = time.perf_counter()
        try:
            outcomes = self.ingestor.examine_many(paths)
            log.debug("examined %d paths in %.3f s", len(paths), time.perf_counter() - t0)
        except Exception:
            if len(paths) == 1:
                log.exception("ingest of %s failed; will retry on the next rescan", paths[0])
                return
            log.warning("ingest of a batch of %d paths failed; retrying them one by one", len(paths), exc_info=True)
            for path in paths:
                self._examine([path])
            return
        for path, outcome in outcomes.items():
            if outcome == "unsettled":
                self.poke(path, self.settle_seconds)

    @staticmethod
    def _safe(fn) -> bool:  # noqa: ANN001
        try:
            fn()
            return True
        except Exception:  # the catalog may be briefly unreachable; the next rescan repairs
            log.exception("ingest step failed; will retry on the next rescan")
            return False
