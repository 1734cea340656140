"""A keyed work queue: work for one key coalesces, and at most one worker holds a key at a time.

In the style of etcd's ``pkg/schedule`` and client-go's ``workqueue``. The verifier keys by
checkpoint (one save's shards, arriving in several event batches, join one entry and one
transaction; no two workers claim or step-check one checkpoint at once). Call order:
``add(key, items)`` from any thread → ``take()`` in a worker (None once closed) → ``done(key)``
however the work ended → ``drain()`` / ``close()``.

* An entry is a dict of items; an item added twice merges its values (``merge``). An ``add``
  without items still queues the key ("look at it again").
* Items the key's worker holds are not queued again (its work covers them), and an ``add`` of
  only such items does nothing; anything else added meanwhile waits until ``done``.
* ``take`` hands out at most ``batch`` items of the oldest entry whose key is not held; the rest
  keep their place at the head. ``close`` drops what is queued and ignores later adds.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
I = TypeVar("I", bound=Hashable)  # noqa: E741
V = TypeVar("V")


class KeyedQueue(Generic[K, I, V]):
    def __init__(self, batch: int, merge: Callable[[V, V], V]) -> None:
        self.batch, self._merge = batch, merge
        self._cond = threading.Condition()
        self._queued: dict[K, dict[I, V]] = {}  # insertion-ordered: FIFO by a key's first add
        self._held: dict[K, tuple[dict[I, V], float, str]] = {}  # key -> (items in hand, since, worker)
        self._closed = False

    def add(self, key: K, items: dict[I, V] | None = None) -> None:
        with self._cond:
            if self._closed:
                return
            held = self._held.get(key)
            fresh = {i: v for i, v in (items or {}).items() if held is None or i not in held[0]}
            if items and not fresh:
                return
            entry = self._queued.setdefault(key, {})
            for i, v in fresh.items():
                entry[i] = self._merge(entry[i], v) if i in entry else v
            self._cond.notify_all()

    def take(self, *, wait: bool = True) -> tuple[K, dict[I, V]] | None:
        """The oldest entry whose key no worker holds, at most ``batch`` of its items; the caller
        holds the key until ``done(key)``. None once closed (or, with ``wait=False``, when there
        is nothing to take now)."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                key = next((k for k in self._queued if k not in self._held), None)
                if key is not None:
                    break
                if not wait:
                    return None
                self._cond.wait()
            entry = self._queued[key]
            items = dict(itertools.islice(entry.items(), self.batch))
            if len(items) == len(entry):
                del self._queued[key]
            else:
                for i in items:
                    del entry[i]
            self._held[key] = (items, time.monotonic(), threading.current_thread().name)
            return key, items

    def done(self, key: K) -> None:
        with self._cond:
            del self._held[key]
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not (self._queued or self._held)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or held; False: timed out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queued or self._held:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def busy(self) -> dict[str, float]:
        """Workers holding a key: thread name → when they took it (``time.monotonic()``)."""
        with self._cond:
            return {worker: since for _, since, worker in self._held.values()}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queued.clear()
            self._cond.notify_all()
