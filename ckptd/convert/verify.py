"""Verifying a destination file against its sources, piece by piece, without reading it again.

For every tensor the assembler hashed each piece's *source* region (xxh3-128, C order) while
copying. The writer hands each band of the *destination* tensor to a :class:`PieceCheck` just
before writing it -- the bytes in hand, exactly those given to ``write(2)`` -- which hashes each
piece's destination region and compares: a mismatch (assembly bug, wrong plan application,
memory error) fails the rank before anything is renamed into place. Once the file is complete
and fsynced, :func:`check_index` opens it like any reader would and checks its index against the
plan: the same entries, dtypes and shapes, every tensor's payload at exactly the bytes that were
written, and the small values (strings, ``rank_id``).

Until issue 16 a background thread re-read every tensor from the file (``pread``) and hashed that
instead. Those reads came from the page cache the writer had just filled, so they checked the
kernel's copy, not the disk, and they were most of a conversion's time (a warm tp4 -> tp2 of
1.2 GiB: 0.7 s without them, 1.5-5.6 s with them, bench/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from ckptd.convert.plan import ConvertError, TensorTask
from ckptd.convert.plan_types import band_rows
from ckptd.convert.sources import hash_update
from ckptd.convert.writers import Segments
from ckptd.format.checkpoint import open_checkpoint
from ckptd.format.dtypes import STR_TYPE, numpy_dtype

ViewAt = Callable[[int, int], Any]  # plaintext bytes [offset, offset+length) of the file, as a buffer


def _payload(segments: Segments, start: int, length: int, view_at: ViewAt, buf: np.ndarray) -> Any:
    """Payload bytes ``[start, start+length)`` of an entry laid out as ``segments``: a view when
    they lie in one segment (the usual case), else gathered into ``buf``."""
    pos = 0
    for off, seg_len in segments:
        if pos <= start and start + length <= pos + seg_len:
            return view_at(off + start - pos, length)
        pos += seg_len
    dest, pos, end = memoryview(buf)[:length], 0, start + length
    for off, seg_len in segments:
        lo, hi = max(start, pos), min(end, pos + seg_len)
        if lo < hi:
            dest[lo - start : hi - start] = view_at(off + lo - pos, hi - lo)
        pos += seg_len
    return dest


class PieceCheck:
    """Hashes each piece's destination region of one tensor from its bands (whole rows of dim 0,
    in order, as the assembler makes them: ``band_rows``), then compares with the source digests."""

    def __init__(self, task: TensorTask, path: str) -> None:
        self.task, self.path = task, path
        self.dt = numpy_dtype(task.dtype) if task.pieces and task.nbytes else None
        self.shape = tuple(task.dst_slice.sizes)
        self.hashers = [xxhash.xxh3_128() for _ in task.pieces]
        self.row = 0  # rows of dim 0 hashed so far

    def update(self, data: Any) -> None:
        """The next band's bytes (the next whole rows of the tensor, or a 0-d tensor's element)."""
        if self.dt is None:
            return
        if not self.shape:
            hash_update(self.hashers[0], np.frombuffer(data, self.dt, count=1).reshape(()))
            return
        row_bytes = self.task.nbytes // self.shape[0]
        n = len(data) // row_bytes
        b0, b1 = self.row, self.row + n
        arr = np.frombuffer(data, self.dt, count=n * row_bytes // self.dt.itemsize).reshape((n,) + self.shape[1:])
        for i, p in enumerate(self.task.pieces):
            d0 = p.dst_region.offsets[0]
            lo, hi = max(b0, d0), min(b1, d0 + p.dst_region.sizes[0])
            if lo < hi:
                hash_update(self.hashers[i], arr[(slice(lo - b0, hi - b0),) + p.dst_region.index[1:]])
        self.row = b1

    def bands(self, bands: Iterable[Any]) -> Iterator[Any]:
        """``bands`` (objects with ``.data``), each hashed before it is passed on to be written."""
        for band in bands:
            self.update(band.data)
            yield band

    def check(self, digests: Sequence[bytes]) -> int:
        """Raise unless every piece matches its source digest; returns the pieces checked."""
        if self.dt is None:
            return len(self.task.pieces)
        for piece, h, digest in zip(self.task.pieces, self.hashers, digests):
            if h.digest() != digest:
                raise ConvertError(
                    f"verification failed: {self.task.name!r} region {list(piece.dst_region.offsets)}+"
                    f"{list(piece.dst_region.sizes)} differs from source rank {piece.src_rank}", path=self.path,
                    hint="the output was not written correctly (disk or memory error?); nothing was renamed into place",
                )
        return len(self.task.pieces)


def verify_pieces(task: TensorTask, segments: Segments, digests: Sequence[bytes], view_at: ViewAt,
                  buf: np.ndarray, path: str) -> int:
    """Hash every piece's destination region of a payload read from a file (``view_at``) band by
    band; returns pieces checked (what :class:`PieceCheck` does for bands in hand)."""
    check = PieceCheck(task, path)
    if check.dt is not None:
        if not check.shape:
            check.update(_payload(segments, 0, check.dt.itemsize, view_at, buf))
        else:
            rows = check.shape[0]
            row_bytes = task.nbytes // rows
            per = band_rows(check.shape, check.dt.itemsize)
            for b0 in range(0, rows, per):
                b1 = min(rows, b0 + per)
                check.update(_payload(segments, b0 * row_bytes, (b1 - b0) * row_bytes, view_at, buf))
    return check.check(digests)


def check_index(path: str, key: bytes | None, tasks: Sequence[TensorTask], written: Mapping[str, Segments],
                values: Mapping[str, Any]) -> int:
    """Open the finished file as a reader would and check it against the plan (see module doc).

    ``written``: where the writer put each entry's payload; ``values``: expected small values.
    Returns the number of values checked.
    """
    checked = 0
    with open_checkpoint(path, key) as cf:
        if cf.problems:
            raise ConvertError(f"output file does not index cleanly: {cf.problems[0].message}", path=path)
        names = sorted(t.name for t in tasks)
        if sorted(cf.entries) != names:
            raise ConvertError(f"output holds entries {sorted(cf.entries)} instead of {names}", path=path)
        for task in tasks:
            ent = cf.entry(task.name)
            want_shape = task.dst_slice.sizes if task.dtype != STR_TYPE else ent.shape
            if ent.dtype != task.dtype or tuple(ent.shape) != tuple(want_shape):
                raise ConvertError(f"entry {task.name!r} is {ent.dtype}{list(ent.shape)} instead of "
                                   f"{task.dtype}{list(want_shape)}", path=path)
            if tuple(ent.segments) != tuple(written[task.name]):
                raise ConvertError(f"entry {task.name!r} is indexed at {list(ent.segments)} but was written at "
                                   f"{list(written[task.name])}", path=path)
            if task.name in values:
                got = cf.value(task.name)
                if (got.item() if isinstance(got, np.ndarray) and got.size == 1 else got) != values[task.name]:
                    raise ConvertError(f"entry {task.name!r} reads back as {got!r} instead of "
                                       f"{values[task.name]!r}", path=path)
                checked += 1
    return checked
