"""Verifying a written destination file: re-read it and compare with the sources, piece by piece.

For every tensor the assembler hashed each piece's *source* region (xxh3-128, C order) while
copying. Here the *output* is re-read from the file -- through the kernel, at the offsets the
writer reports -- band by band, and each piece's *destination* region is hashed and compared: a
mismatch (writer bug, wrong plan application, memory or disk error) fails the rank before
anything is renamed into place.

For plain files this runs on its own thread while the writer is still writing later tensors
(:class:`BackgroundVerifier`, ``pread`` into one reused buffer). Once the file is complete and
fsynced, :func:`check_index` opens it like any reader would and checks its index against the plan: the same entries, dtypes and shapes, every tensor's payload at exactly the
bytes that were verified, and the small values (strings, ``rank_id``). Encrypted output cannot be
re-read before it is complete; its pieces are verified there, through the decrypting reader.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from ckptd.convert.plan import ConvertError, TensorTask
from ckptd.convert.plan_types import band_rows
from ckptd.convert.sources import hash_update
from ckptd.convert.writers import Segments, start_writeback
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


def verify_pieces(task: TensorTask, segments: Segments, digests: Sequence[bytes], view_at: ViewAt,
                  buf: np.ndarray, path: str) -> int:
    """Hash every piece's destination region of the re-read payload; returns pieces checked."""
    if not task.pieces or not task.nbytes:
        return len(task.pieces)
    dt = numpy_dtype(task.dtype)
    shape = tuple(task.dst_slice.sizes)
    hashers = [xxhash.xxh3_128() for _ in task.pieces]
    if not shape:
        hash_update(hashers[0], np.frombuffer(_payload(segments, 0, dt.itemsize, view_at, buf), dt).reshape(()))
    else:
        rows = shape[0]
        row_bytes = task.nbytes // rows
        per = band_rows(shape, dt.itemsize)
        for b0 in range(0, rows, per):
            b1 = min(rows, b0 + per)
            data = _payload(segments, b0 * row_bytes, (b1 - b0) * row_bytes, view_at, buf)
            arr = np.frombuffer(data, dt).reshape((b1 - b0,) + shape[1:])
            for i, p in enumerate(task.pieces):
                d0 = p.dst_region.offsets[0]
                lo, hi = max(b0, d0), min(b1, d0 + p.dst_region.sizes[0])
                if lo < hi:
                    hash_update(hashers[i], arr[(slice(lo - b0, hi - b0),) + p.dst_region.index[1:]])
    for piece, h, digest in zip(task.pieces, hashers, digests):
        if h.digest() != digest:
            raise ConvertError(
                f"verification failed: {task.name!r} region {list(piece.dst_region.offsets)}+"
                f"{list(piece.dst_region.sizes)} differs from source rank {piece.src_rank}", path=path,
                hint="the output was not written correctly (disk or memory error?); nothing was renamed into place",
            )
    return len(task.pieces)


class BackgroundVerifier:
    """Verifies tensors of a plain output file on its own thread as soon as they are written.

    Each tensor's bytes are read back band by band from the page cache the writer just filled and
    hashed; then their write-back to disk is started, so the disk works while later tensors are
    produced and the final fsync waits for little (the writer never blocks on it).
    """

    def __init__(self, path: str, buf: np.ndarray, read_buf: np.ndarray) -> None:
        """``read_buf``: where bands are read (``pread``, one reused buffer: a mapping per tensor
        was measured slower, its mmap/munmap stall the assembler's page faults); ``buf``: where a
        band crossing a record boundary is gathered."""
        self.path, self.buf, self.read_buf = path, buf, read_buf
        self.checked = 0
        self.error: BaseException | None = None
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._queue: queue.Queue[tuple[TensorTask, Segments, Sequence[bytes]] | None] = queue.Queue()
        self._kicked = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="ckptd-verify")
        self._thread.start()

    def submit(self, task: TensorTask, segments: Segments, digests: Sequence[bytes]) -> None:
        """Queue a tensor whose bytes are all in the kernel (written, not necessarily synced)."""
        self._queue.put((task, segments, digests))

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self.error is not None:
                continue  # drain: the rank has failed already
            try:
                self._verify(*job)
            except BaseException as exc:  # noqa: BLE001 -- raised by finish() on the writer thread
                self.error = exc

    def _read(self, offset: int, length: int) -> memoryview:
        dest = view = memoryview(self.read_buf)[:length]
        while len(dest):
            n = os.preadv(self._fd, [dest], offset)
            if n <= 0:
                raise ConvertError(f"output file ends before byte {offset}", path=self.path)
            dest, offset = dest[n:], offset + n
        return view

    def _verify(self, task: TensorTask, segments: Segments, digests: Sequence[bytes]) -> None:
        if segments and task.pieces and task.nbytes:
            self.checked += verify_pieces(task, segments, digests, self._read, self.buf, self.path)
        else:
            self.checked += len(task.pieces)
        if segments:
            hi = segments[-1][0] + segments[-1][1]
            start_writeback(self._fd, self._kicked, hi - self._kicked)
            self._kicked = hi

    def finish(self) -> int:
        """Wait for every queued tensor; raise the first failure; returns pieces checked."""
        self.close()
        if self.error is not None:
            raise self.error
        return self.checked

    def close(self) -> None:
        if self._fd >= 0:
            self._queue.put(None)
            self._thread.join()
            os.close(self._fd)
            self._fd = -1


def check_index(path: str, key: bytes | None, tasks: Sequence[TensorTask], written: Mapping[str, Segments],
                values: Mapping[str, Any], deferred: Sequence[tuple[TensorTask, Sequence[bytes]]] = (),
                buf: np.ndarray | None = None) -> int:
    """Open the finished file as a reader would and check it against the plan (see module doc).

    ``written``: where the writer put each entry's payload; ``values``: expected small values;
    ``deferred``: tensors whose pieces were not verified yet (encrypted output), checked here.
    Returns the number of values and deferred pieces checked.
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
        if deferred:
            assert buf is not None
            source = cf.source

            for task, digests in deferred:
                checked += verify_pieces(task, written[task.name], digests, source.view, buf, path)
    return checked
