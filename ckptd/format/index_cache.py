"""Parsed ``.ckpt`` record indexes, reused while a file is provably unchanged.

The daemon opens each new shard three times within seconds — ingest (does it parse?),
verification (CRC, digest, content) and the step checks (shapes, replicas) — and for small shards
parsing the protobuf records is most of the cost. An :class:`IndexCache` passed to
``open_checkpoint`` lets the later opens reuse the first parse.

A hit requires the same (device, inode, size, mtime, ctime) *of the open descriptor* — not the
same name: the daemon opens shards through ``/proc/self/fd`` names (:mod:`ckptd.storage.beneath`). Any
write through the file system changes mtime and ctime, and putting an old mtime back (``utime``)
changes ctime, so a cached index always describes the bytes as they were written. Damage below the
file system (bit rot) is invisible to an index anyway; CRCs and digests read the bytes every time.
Only plaintext ``.ckpt`` indexes are kept (offsets and shapes, never tensor data), bounded by the
total number of tensor entries so memory stays small whatever the shard size.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from ckptd.format.ckpt import CkptIndex

CacheKey = tuple[int, int, int, int, int]


class IndexCache:
    """Thread-safe LRU of ``CkptIndex`` objects (shared read-only between threads)."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries  # tensor entries over all cached indexes
        self._items: OrderedDict[CacheKey, CkptIndex] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def key_for(st: os.stat_result) -> CacheKey:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)  # of the file, whatever its name

    def get(self, key: CacheKey) -> CkptIndex | None:
        with self._lock:
            idx = self._items.get(key)
            if idx is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return idx

    def put(self, key: CacheKey, idx: CkptIndex) -> None:
        cost = max(1, len(idx.entries))
        if cost > self.max_entries:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._size -= max(1, len(old.entries))
            self._items[key] = idx
            self._size += cost
            while self._size > self.max_entries:
                _, evicted = self._items.popitem(last=False)
                self._size -= max(1, len(evicted.entries))
