"""Writing one destination file: MindSpore's exact bytes, streamed from bands, with early write-back.

The payload of a destination tensor arrives as *bands* (consecutive C-order byte runs of at most
a few MiB: zero-copy views of a source file, or pooled buffers the assembler filled); the writers
frame them into records exactly as ``write_checkpoint`` / MindSpore would (same record headers,
same >512 MiB split, same CRC trailer; tests/test_convert.py pins byte equality) without ever
holding a whole tensor. Each writer returns where every tensor's payload landed (plaintext
offsets) so the file's index can be checked against exactly those bytes.

:class:`OutFile` is the raw file; write-back of what was written is started early
(``sync_file_range`` every ``KICK_BYTES``, on a helper thread: the call can block while the disk
queue is full, and the writer must not) so the disk works while we produce the rest and the final
``fsync`` only waits for the tail; otherwise the kernel would hold every page dirty until that fsync.
It also hashes every byte as it is handed to the kernel (xxh3-128, the digest the catalog keeps of
every file): a written set records its digests without reading its output back
(:mod:`ckptd.convert.manifest`). A file patched in place (safetensors' header, rewritten once its
CRC is known) has no streamed digest: xxh3 must see the bytes in file order.
"""

from __future__ import annotations

import ctypes
import math
import os
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ckptd.convert.plan import ConvertError, TensorTask
from ckptd.format import ckpt as ckpt_fmt
from ckptd.format import ckpt_write
from ckptd.format import safetensors_format as st_fmt
from ckptd.format import safetensors_write as st_write
from ckptd.format.crc import crc32, crc32_combine
from ckptd.format.dtypes import safetensors_name

Segments = tuple[tuple[int, int], ...]
KICK_BYTES = 32 << 20
_SMALL_WRITE = 256 << 10
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc: the final fsync does all the work
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Queue ``[offset, offset+length)`` of a file for write-out and return (errors: fsync reports)."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


@dataclass
class Band:
    """Consecutive payload bytes of one tensor; ``done()`` is called once they are written."""

    data: memoryview
    done: Callable[[], None]


class OutFile:
    """A new file written front to back (``pwrite`` only for safetensors' header at the end).

    Small writes (record headers) are coalesced; big ones go straight to ``write(2)``. (Copying
    into a shared mapping of the file instead was measured slower here: its page faults contend
    with the mappings the assembler and verifier open and drop.)
    """

    def __init__(self, path: str, *, dir_fd: int | None = None) -> None:
        """A new file: ``path``, or with ``dir_fd`` the file named ``basename(path)`` in that
        directory descriptor (``path`` then only names it in messages): the executor writes by
        descriptor, so a directory swapped for a symlink cannot redirect it (``ckptd.storage``)."""
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(path if dir_fd is None else os.path.basename(path), flags, 0o644, dir_fd=dir_fd)
        self._small = bytearray()
        self._hash = xxhash.xxh3_128()  # of bytes [0, _in_kernel), in file order
        self._patched = False  # a pwrite changed hashed bytes: no streamed digest
        self._in_kernel = 0  # bytes handed to write(2)
        self._kicked = 0  # bytes whose write-back was started
        self._cond = threading.Condition()
        self._closing = False
        self._kicker: threading.Thread | None = None
        if _sync_file_range is not None:  # write-back starts every KICK_BYTES
            self._kicker = threading.Thread(target=self._kick_loop, daemon=True, name="ckptd-writeback")
            self._kicker.start()

    def _kick_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing and self._in_kernel - self._kicked < KICK_BYTES:
                    self._cond.wait()
                if self._closing:
                    return
                start, end = self._kicked, self._in_kernel
                self._kicked = end
            start_writeback(self.fd, start, end - start)

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        if len(mv) < _SMALL_WRITE:
            self._small += mv
            if len(self._small) >= _SMALL_WRITE:
                self.flush()
        else:
            self.flush()
            self._write_all(mv)
        return len(mv)

    def _write_all(self, mv: memoryview) -> None:
        self._hash.update(mv)
        while len(mv):
            n = os.write(self.fd, mv)
            mv = mv[n:]
            self._in_kernel += n
        if self._kicker is not None and self._in_kernel - self._kicked >= KICK_BYTES:
            with self._cond:
                self._cond.notify()

    def flush(self) -> None:
        """Hand coalesced small writes to the kernel (the verifier reads through it)."""
        if self._small:
            small, self._small = self._small, bytearray()
            self._write_all(memoryview(small))

    def pwrite(self, data: bytes, offset: int) -> None:
        self.flush()
        self._patched = True
        mv = memoryview(data)
        while len(mv):
            n = os.pwrite(self.fd, mv, offset)
            mv, offset = mv[n:], offset + n

    def _stop_kicker(self) -> None:
        if self._kicker is not None:
            with self._cond:
                self._closing = True
                self._cond.notify()
            self._kicker.join()
            self._kicker = None

    def digest(self) -> str | None:
        """xxh3-128 of the whole file as written (after :meth:`finish`); None once patched in place."""
        return None if self._patched else self._hash.hexdigest()

    def finish(self) -> None:
        """Everything written and durable (fsync)."""
        self.flush()
        self._stop_kicker()
        os.fsync(self.fd)

    def close(self) -> None:
        self._stop_kicker()  # before the descriptor goes: the helper must not kick a reused fd
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CkptWriter:
    """MindSpore ``.ckpt`` records (plain, or into an encrypting writer), CRC chained over them."""

    def __init__(self, out: Any, *, crc: bool) -> None:
        self.out, self.crc_enabled, self.crc, self.pos = out, crc, 0, 0

    def _emit(self, b: Any) -> None:
        if self.crc_enabled:
            self.crc = crc32(b, self.crc)
        self.out.write(b)
        self.pos += len(b)

    def write_value(self, name: str, value: Any) -> Segments:
        """A small value (str, scalar, ``rank_id``) through the reference encoder."""
        dtype, dims, data = ckpt_write.normalise_value(name, value)
        segments = []
        for chunk in ckpt_write.record_chunks(data):
            self._emit(ckpt_write.record_header(name, dtype, dims, len(chunk)))
            segments.append((self.pos, len(chunk)))
            self._emit(chunk)
        return tuple(segments)

    def write_bands(self, task: TensorTask, bands: Iterable[Band]) -> Segments:
        """A tensor whose C-order payload arrives as ``bands``, split into records like ``ckpt_write.record_chunks``."""
        dims = tuple(task.dst_slice.sizes)
        sizes = record_sizes(dims, task.nbytes)
        segments: list[tuple[int, int]] = []
        it = iter(bands)
        pending: memoryview | None = None
        band: Band | None = None
        for size in sizes:
            self._emit(ckpt_write.record_header(task.name, task.dtype, dims, size))
            segments.append((self.pos, size))
            left = size
            while left:
                if pending is None or not len(pending):
                    if band is not None:
                        band.done()
                    band = next(it, None)
                    if band is None:
                        raise ConvertError(f"internal error: payload of {task.name!r} ended {left} bytes early")
                    pending = band.data
                take = min(left, len(pending))
                self._emit(pending[:take])
                pending, left = pending[take:], left - take
        if band is not None:
            band.done()
        if (pending is not None and len(pending)) or next(it, None) is not None:
            raise ConvertError(f"internal error: payload of {task.name!r} longer than {task.nbytes} bytes")
        return tuple(segments)

    def finish(self) -> None:
        if self.crc_enabled:
            self.out.write(ckpt_fmt.CRC_MAGIC + self.crc.to_bytes(10, "big"))


def record_sizes(dims: tuple[int, ...], nbytes: int) -> list[int]:
    """Payload bytes of each record, as ``ckpt_write.record_chunks`` splits (``np.array_split`` over dim 0
    into ``ceil(nbytes / 512 MiB)`` parts; the same float arithmetic, so the same boundaries)."""
    if not (nbytes / 1024 > ckpt_fmt.SLICE_BYTES / 1024 and len(dims) > 0):
        return [nbytes]
    parts = math.ceil(nbytes / 1024 / (ckpt_fmt.SLICE_BYTES / 1024))
    rows = dims[0]
    row_bytes = nbytes // rows if rows else 0
    q, r = divmod(rows, parts)
    return [(q + 1) * row_bytes] * r + [q * row_bytes] * (parts - r)


def safetensors_order(tasks: Iterable[TensorTask]) -> list[TensorTask]:
    """safetensors' data order: descending dtype alignment rank, then name."""
    return sorted(tasks, key=lambda t: (-st_fmt.ST_DTYPE_RANK[safetensors_name(t.dtype)], t.name.encode()))


class SafetensorsWriter:
    """A MindSpore-style safetensors file streamed in ``tasks`` (= file) order.

    The header goes first but ``crc_num`` (over sorted names) is only known at the end: the header
    is reserved at the size it has with the longest possible value and rewritten in place, padded
    with spaces (JSON whitespace, as safetensors itself pads), so the data never moves.
    """

    def __init__(self, out: OutFile, tasks: list[TensorTask], *, crc: bool) -> None:
        layout, pos = [], 0
        for t in tasks:
            layout.append((t.name, safetensors_name(t.dtype), tuple(t.dst_slice.sizes), pos, pos + t.nbytes))
            pos += t.nbytes
        self.out, self.tasks, self.layout = out, tasks, layout
        self.meta = {"format": "ms"} if tasks else None
        self.with_crc = bool(self.meta) and crc
        meta = {**self.meta, "crc_num": "4294967295"} if self.with_crc else self.meta  # type: ignore[dict-item]
        self.reserved = st_write.encode_header(meta, layout)
        out.write(struct.pack("<Q", len(self.reserved)))
        out.write(self.reserved)
        self.pos = 8 + len(self.reserved)
        self.crcs: dict[str, tuple[int, int, bytes | None]] = {}

    def write_bands(self, task: TensorTask, bands: Iterable[Band]) -> Segments:
        start, value_crc, first = self.pos, 0, b""
        for band in bands:
            if self.with_crc:
                value_crc = crc32(band.data, value_crc)
            if not first and task.dst_slice.sizes == () and len(band.data):
                first = bytes(band.data)
            self.out.write(band.data)
            self.pos += len(band.data)
            band.done()
        if self.pos - start != task.nbytes:
            raise ConvertError(f"internal error: payload of {task.name!r} is {self.pos - start} bytes, not {task.nbytes}")
        self.crcs[task.name] = (value_crc, task.nbytes, first if task.dst_slice.sizes == () else None)
        return ((start, task.nbytes),)

    def finish(self) -> None:
        if not self.with_crc:
            return
        assert self.meta is not None
        value_crc = 0
        dtypes = {t.name: t.dtype for t in self.tasks}
        for name in sorted(self.crcs, key=lambda s: s.encode()):
            dcrc, length, scalar = self.crcs[name]
            value_crc = crc32(name.encode(), value_crc)
            if scalar is not None and dtypes[name] in st_fmt.INDEX_QUIRK_DTYPES:
                value_crc = st_fmt.crc32_zeros(value_crc, st_fmt.scalar_index(dtypes[name], scalar, name))
            else:
                value_crc = crc32_combine(value_crc, dcrc, length)
        header = st_write.encode_header({**self.meta, "crc_num": str(value_crc)}, self.layout)
        self.out.pwrite(header + b" " * (len(self.reserved) - len(header)), 8)


def np_bytes(arr: np.ndarray) -> memoryview:
    """The C-order bytes of a contiguous array (any dtype, 0-d included) as a flat memoryview."""
    return memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
