"""Producing one destination rank's tensors as bands, ahead of the writer, in bounded memory.

A producer thread walks the rank's tasks in file order and emits, for each tensor, its C-order
payload as bands of whole dim-0 rows (about ``BAND_BYTES``), while the writer thread writes the
previous bands: copying from the sources overlaps writing and the disk. A band is

* a zero-copy view of a source file when its rows come from one contiguous source region (a
  whole source shard, or full rows of one: dim-0 splits, copied entries) -- nothing is assembled;
* otherwise one of the rank's pooled buffers, filled piece by piece from row chunks of the
  sources (dim-1 splits, partial blocks).

Every piece's source region is hashed (xxh3-128, C order) as it is read, for the verifier.
Memory: the queue holds at most ``PIPELINE_BANDS`` bands and the pool as many buffers, so a rank
needs a few bands' worth of memory whatever its tensor sizes; mapped source pages are dropped
once their band is written.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ckptd.convert.plan import ConvertError, TensorTask
from ckptd.convert.plan_types import PIPELINE_BANDS, band_bytes, band_rows
from ckptd.convert.sources import OpenSources, checked_entry, hash_update, payload_view, source_rows
from ckptd.convert.writers import Band, np_bytes
from ckptd.format.dtypes import STR_TYPE, itemsize, numpy_dtype

_POLL_S = 0.1  # how often a blocked producer looks whether the conversion was stopped


class Stopped(ConvertError):
    """The rank's pipeline was stopped (its writer failed, or another rank did)."""


@dataclass
class ValueItem:
    """A whole small value written through the reference encoder (strings)."""

    task: TensorTask
    value: Any


@dataclass
class ArrayStart:
    task: TensorTask


@dataclass
class ArrayEnd:
    """After a tensor's last band: the digests of its pieces' source regions (plan order)."""

    task: TensorTask
    digests: tuple[bytes, ...]


Item = ValueItem | ArrayStart | Band | ArrayEnd


def _noop() -> None:
    return None


class BufferSet:
    """One worker's reusable band buffers.

    Reused across every rank the worker converts: fresh memory costs a page fault per 4 KiB on
    first touch (slow on VMs), reused memory does not.
    """

    def __init__(self) -> None:
        self.bands: list[np.ndarray] = []

    def prepare(self, tasks: Sequence[TensorTask]) -> int:
        """Grow the buffers to this rank's largest band; returns that size."""
        size = max((band_bytes(t.dst_slice.sizes, itemsize(t.dtype)) for t in tasks if t.nbytes), default=0)
        if len(self.bands) < PIPELINE_BANDS or any(b.nbytes < size for b in self.bands):
            self.bands = []  # drop the old ones before allocating bigger ones
            self.bands = [np.empty(max(size, 1), np.uint8) for _ in range(PIPELINE_BANDS)]
        return size


class _Pool:
    def __init__(self, buffers: Sequence[np.ndarray], stopped: Callable[[], bool]) -> None:
        self._free: queue.Queue[np.ndarray] = queue.Queue()
        for b in buffers:
            self._free.put(b)
        self._stopped = stopped

    def take(self) -> np.ndarray:
        while True:
            try:
                return self._free.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stopped():
                    raise Stopped("conversion aborted") from None

    def give(self, buf: np.ndarray) -> None:
        self._free.put(buf)


class Pipeline:
    """Runs the producer on its own thread; iterating yields its items in order.

    ``close()`` (always call it) stops the producer, returns every queued band and joins.
    """

    def __init__(self, rank: int, tasks: Sequence[TensorTask], sources: OpenSources, buffers: BufferSet,
                 abort: threading.Event) -> None:
        self._stop = threading.Event()
        self._abort = abort
        self._queue: queue.Queue[Item | BaseException | None] = queue.Queue(maxsize=PIPELINE_BANDS)
        buffers.prepare(tasks)  # a no-op when the caller prepared them already
        self._pool = _Pool(buffers.bands, self.stopped)
        self._thread = threading.Thread(target=self._run, args=(rank, tasks, sources), daemon=True,
                                        name=f"ckptd-assemble-{rank}")
        self._thread.start()

    def stopped(self) -> bool:
        return self._stop.is_set() or self._abort.is_set()

    def _put(self, item: Item | BaseException | None) -> None:
        while True:
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                if self.stopped():
                    if isinstance(item, Band):
                        item.done()
                    raise Stopped("conversion aborted") from None

    def _run(self, rank: int, tasks: Sequence[TensorTask], sources: OpenSources) -> None:
        try:
            for task in tasks:
                if self.stopped():
                    raise Stopped("conversion aborted because another rank failed")
                self._produce(rank, task, sources)
            self._put(None)
        except Stopped:
            return
        except BaseException as exc:  # noqa: BLE001 -- handed to the writer thread, which raises it
            try:
                self._put(exc)
            except Stopped:
                return

    def __iter__(self) -> Iterator[Item]:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():  # it stopped without a word
                    raise Stopped("conversion aborted because another rank failed") from None
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive() or not self._queue.empty():
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, Band):
                item.done()
        self._thread.join()

    # --- producing ---------------------------------------------------------------------------

    def _produce(self, rank: int, task: TensorTask, sources: OpenSources) -> None:
        if task.kind == "rank_id":
            if task.dtype == STR_TYPE:
                self._put(ValueItem(task, str(rank)))
                return
            arr = np.full(task.dst_slice.sizes, rank, dtype=numpy_dtype(task.dtype))
            self._put(ArrayStart(task))
            self._put(Band(np_bytes(arr), _noop))
            self._put(ArrayEnd(task, ()))
            return
        if task.dtype == STR_TYPE:
            self._put(ValueItem(task, sources.get(task.pieces[0].src_rank).value(task.name)))
            return
        self._put(ArrayStart(task))
        hashers = [xxhash.xxh3_128() for _ in task.pieces]
        if task.nbytes:
            self._bands(task, sources, hashers)
        self._put(ArrayEnd(task, tuple(h.digest() for h in hashers)))

    def _bands(self, task: TensorTask, sources: OpenSources, hashers: list[Any]) -> None:
        dt = numpy_dtype(task.dtype)
        shape = tuple(task.dst_slice.sizes)
        if not shape:  # a 0-d tensor: one element from its one piece
            buf = self._pool.take()
            arr = buf[: dt.itemsize].view(dt).reshape(())
            piece = task.pieces[0]
            cf = sources.get(piece.src_rank)
            ent = checked_entry(cf, task.name)
            view, release = payload_view(cf, ent, 0, dt.itemsize)
            chunk = np.frombuffer(view, dtype=dt).reshape(())
            arr[...] = chunk
            hash_update(hashers[0], chunk)
            del chunk, view
            release()
            self._put(Band(np_bytes(arr), lambda: self._pool.give(buf)))
            return
        rows = shape[0]
        per = band_rows(shape, dt.itemsize)
        row_bytes = task.nbytes // rows
        for b0 in range(0, rows, per):
            b1 = min(rows, b0 + per)
            hits = [(i, p) for i, p in enumerate(task.pieces)
                    if p.dst_region.offsets[0] < b1 and b0 < p.dst_region.offsets[0] + p.dst_region.sizes[0]]
            if len(hits) == 1 and self._direct(task, hits[0], b0, b1, sources, hashers):
                continue
            buf = self._pool.take()
            try:
                arr = buf[: (b1 - b0) * row_bytes].view(dt).reshape((b1 - b0,) + shape[1:])
                for i, p in hits:
                    d0 = p.dst_region.offsets[0]
                    lo, hi = max(b0, d0), min(b1, d0 + p.dst_region.sizes[0])
                    target = arr[(slice(lo - b0, hi - b0),) + p.dst_region.index[1:]]
                    cf = sources.get(p.src_rank)
                    ent = checked_entry(cf, task.name)
                    first = p.src_region.offsets[0] + lo - d0
                    for off, chunk in source_rows(cf, ent, first, hi - lo, p.src_region.index[1:]):
                        target[off : off + chunk.shape[0]] = chunk
                        hash_update(hashers[i], chunk)
                band = Band(np_bytes(arr), lambda b=buf: self._pool.give(b))  # type: ignore[misc]
            except BaseException:
                self._pool.give(buf)
                raise
            self._put(band)

    def _direct(self, task: TensorTask, hit: tuple[int, Any], b0: int, b1: int, sources: OpenSources,
                hashers: list[Any]) -> bool:
        """Emit rows ``[b0, b1)`` as a view of the source when one piece holds them as full rows."""
        i, p = hit
        shape = tuple(task.dst_slice.sizes)
        d0 = p.dst_region.offsets[0]
        if not (d0 <= b0 and b1 <= d0 + p.dst_region.sizes[0]):
            return False
        if tuple(p.dst_region.sizes[1:]) != shape[1:] or tuple(p.src_region.sizes[1:]) != tuple(p.src_shape[1:]):
            return False
        cf = sources.get(p.src_rank)
        ent = checked_entry(cf, task.name)
        row_bytes = task.nbytes // shape[0]
        first = p.src_region.offsets[0] + b0 - d0
        view, release = payload_view(cf, ent, first * row_bytes, (b1 - b0) * row_bytes)
        data = memoryview(view).cast("B")
        hashers[i].update(data)
        self._put(Band(data, release))
        return True
