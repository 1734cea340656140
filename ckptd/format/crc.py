"""CRC-32 (zlib polynomial) as MindSpore uses it, computed in parallel.

MindSpore's ``crc_check`` trailer is ``binascii.crc32`` over every byte before it. One core of
zlib does ~2 GB/s here; we split the range across threads (zlib releases the GIL on large
buffers) and join the partial CRCs with ``crc32_combine`` — the same math zlib uses, which the
Python module does not expose. ``isal`` is used when installed (~1.5x faster per core).
"""

from __future__ import annotations

import concurrent.futures
import os
import zlib
from typing import Callable

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


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC of A+B given crc(A), crc(B) and len(B) (port of zlib's crc32_combine)."""
    if len2 <= 0:
        return crc1
    odd = [_POLY] + [1 << n for n in range(31)]  # operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def parallel_crc32(
    buf: memoryview,
    workers: int | None = None,
    chunk: int = 64 << 20,
    release: Callable[[int, int], None] | None = None,
) -> int:
    """CRC-32 of ``buf`` using up to ``workers`` threads (default: CPU count).

    ``release(offset, length)`` is called after each chunk is done (e.g. to unmap its pages).
    """
    n = len(buf)
    workers = workers or os.cpu_count() or 1
    pieces = [(off, min(chunk, n - off)) for off in range(0, n, chunk)] or [(0, 0)]

    def one(piece: tuple[int, int]) -> int:
        off, length = piece
        value = crc32(buf[off : off + length])
        if release is not None:
            release(off, length)
        return value

    if workers <= 1 or n < _MIN_PARALLEL:
        crcs = [one(p) for p in pieces]
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            crcs = list(pool.map(one, pieces))
    total = crcs[0]
    for (_, length), part in zip(pieces[1:], crcs[1:]):
        total = crc32_combine(total, part, length)
    return total
