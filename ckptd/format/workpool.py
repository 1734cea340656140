"""The threads and the large block buffers every reader in the process shares.

One thread pool for CRC chunks and decryption: a pool per call cost a thread start-up per file,
and several verifier workers each making a pool of cpu_count threads oversubscribed the cores.
No task submitted here waits for another task of the pool, so sharing it cannot deadlock.

Decryption buffers are as large as a MindSpore encryption block (64 MiB). A fresh one costs the
kernel a page fault and a zeroed page per 4 KiB before the first byte is decrypted into it: on a
1.5 GiB AES-GCM shard that was a quarter of the verification's CPU time (0.14 of 0.54 s, warm),
so buffers are handed back here when a file is closed and reused by the next file. At most
``BLOCK_BUFFERS.max_buffers`` are kept (the daemon's RSS between files is bounded by that many
blocks); the rest go back to the allocator.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import threading

CPUS = os.cpu_count() or 1  # os.cpu_count() reads /sys on each call: ~10 µs a small shard paid
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def shared_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's reader pool (cpu_count threads, at least 2), created on first use."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, CPUS),
                                                              thread_name_prefix="ckptd-read")
    return _pool


@atexit.register
def _shutdown_pool() -> None:
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def is_exported(buf: bytearray) -> bool:
    """True while some memoryview/numpy array still refers to ``buf`` (then it must not be reused).

    A bytearray refuses to resize while exported; that is the only public probe CPython offers.
    """
    try:
        buf.append(0)
    except BufferError:
        return True
    del buf[-1]
    return False


class BufferPool:
    """Free list of large bytearrays; ``take`` a buffer of at least ``size`` bytes, ``give`` it back."""

    def __init__(self, max_buffers: int) -> None:
        self.max_buffers = max_buffers
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= size:
                    return self._free.pop(i)
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        """Keep ``buf`` for a later ``take`` unless the pool is full or something still views it."""
        if is_exported(buf):
            return
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(buf)


# Enough for a verifier worker's cache + read-ahead and one decrypting pass in flight.
BLOCK_BUFFERS = BufferPool(max_buffers=4)
