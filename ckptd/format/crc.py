"""CRC-32 (zlib polynomial) as MindSpore uses it, computed in parallel.

MindSpore's ``crc_check`` trailer is ``binascii.crc32`` over every byte before it. One core of
zlib does ~2 GB/s here; we split the range across threads (zlib releases the GIL on large
buffers) and join the partial CRCs with ``crc32_combine`` — the same math zlib uses, which the
Python module does not expose. ``isal`` is used when installed (~1.5x faster per core).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import zlib
from typing import Callable

from ckptd.format.workpool import CPUS, shared_pool

try:  # optional accelerator, identical results
    from isal.isal_zlib import crc32 as _crc32  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32

crc32: Callable[..., int] = _crc32

_POLY = 0xEDB88320
_MIN_PARALLEL = 64 << 20  # below this, thread hand-off costs more than it saves


def _gf2_times(mat: list[int], vec: int) -> int:
    total = 0
    i = 0
    while vec:
        if vec & 1:
            total ^= mat[i]
        vec >>= 1
        i += 1
    return total


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


# _ZEROS[k]: the GF(2) operator that appends 2**k zero *bytes* to a CRC register. zlib squares its
# way up from one zero bit on every call (~70 squarings of a 32x32 matrix for a 2**40 length);
# the operators depend on nothing but k, so they are built once, as far as a length needs them.
_ZEROS: list[list[int]] = []
_ZEROS_LOCK = threading.Lock()


def _zeros_operator(k: int) -> list[int]:
    if k >= len(_ZEROS):
        with _ZEROS_LOCK:
            if not _ZEROS:
                op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
                for _ in range(3):  # 2, 4, 8 zero bits = one zero byte
                    op = _gf2_square(op)
                _ZEROS.append(op)
            while k >= len(_ZEROS):
                _ZEROS.append(_gf2_square(_ZEROS[-1]))
    return _ZEROS[k]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC of A+B given crc(A), crc(B) and len(B) (zlib's crc32_combine; the operators for
    powers of two are cached, so a call costs one matrix-vector product per set bit of len2)."""
    if len2 <= 0:
        return crc1
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_zeros_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def parallel_crc32(
    buf: memoryview,
    workers: int | None = None,
    chunk: int = 64 << 20,
    release: Callable[[int, int], None] | None = None,
    prefetch: Callable[[int, int], None] | None = None,
) -> int:
    """CRC-32 of ``buf`` using up to ``workers`` threads (default: CPU count).

    ``release(offset, length)`` is called after each chunk is done (e.g. to unmap its pages),
    ``prefetch(offset, length)`` for the chunk after the newest one taken (to start its read).
    At most ``workers`` chunks are in flight, taken in file order, so chunks finish roughly in
    order and the caller's memory stays bounded by ``workers`` chunks.
    """
    n = len(buf)
    workers = workers or CPUS
    pieces = [(off, min(chunk, n - off)) for off in range(0, n, chunk)] or [(0, 0)]

    def one(piece: tuple[int, int]) -> int:
        off, length = piece
        value = crc32(buf[off : off + length])
        if release is not None:
            release(off, length)
        return value

    def ahead(i: int) -> None:
        if prefetch is not None and i < len(pieces):
            prefetch(*pieces[i])

    if workers <= 1 or n < _MIN_PARALLEL:
        crcs = []
        for i, p in enumerate(pieces):
            ahead(i + 1)
            crcs.append(one(p))
    else:
        pool = shared_pool()
        crcs = []
        inflight: collections.deque[concurrent.futures.Future[int]] = collections.deque()
        try:
            for i, p in enumerate(pieces):
                if len(inflight) >= workers:
                    crcs.append(inflight.popleft().result())
                inflight.append(pool.submit(one, p))
                ahead(i + 1)
            while inflight:
                crcs.append(inflight.popleft().result())
        finally:
            for fut in inflight:  # an error: the rest is not needed (and must not touch buf later)
                fut.cancel()
            concurrent.futures.wait(inflight)
    total = crcs[0]
    for (_, length), part in zip(pieces[1:], crcs[1:]):
        total = crc32_combine(total, part, length)
    return total
