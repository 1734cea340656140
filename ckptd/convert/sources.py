"""Finding, indexing and reading the source checkpoints of a conversion.

``find_source_files`` maps ``DIR/rank_<r>/`` to files (``--step`` picks one of several, never
file-name order); ``read_inventory`` indexes them (headers only) into the planner's input;
``row_views`` hands out the rows of a source entry as zero-copy views of the mmap'd (or
decrypting) file, each with a function dropping the mapped pages once used, so reading adds only
about one chunk to the process's resident memory whatever the file size.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from ckptd.convert.plan import CHUNK_BYTES, ConversionPlan, ConvertError, ShardEntry, SourceShard, plan_conversion
from ckptd.format.checkpoint import CheckpointFile, open_checkpoint
from ckptd.format.dtypes import numpy_dtype
from ckptd.format.entry import TensorEntry
from ckptd.format.layout import Slice
from ckptd.format.strategy import Strategy, load_strategy

_STEP_NAME = re.compile(r"-(\d+)_(\d+)\.(?:ckpt|safetensors)$")
_RANK_DIR = re.compile(r"rank_(0|[1-9][0-9]*)")


# --- finding and indexing ----------------------------------------------------------------------


def _parse_step(step: int | str | None) -> tuple[int | None, int | None]:
    """``--step`` is ``N`` (the step) or ``E_N`` (epoch and step), as in ``net-E_N.ckpt``."""
    if step is None:
        return None, None
    text = str(step)
    m = re.fullmatch(r"(?:(\d+)_)?(\d+)", text)
    if m is None:
        raise ConvertError(f"--step {text!r} is not N or EPOCH_N", hint="e.g. --step 200 or --step 2_200")
    return (int(m.group(1)) if m.group(1) else None), int(m.group(2))


def find_source_files(src_dir: str | os.PathLike[str], step: int | str | None = None) -> dict[int, str]:
    """``{rank: file}`` for every ``src_dir/rank_<r>/`` holding a checkpoint.

    A rank directory holding several checkpoints needs ``step`` (matched against MindSpore's
    ``<prefix>-<epoch>_<step>.ckpt`` names); file-name order is never used to guess.
    """
    root = os.fspath(src_dir)
    if not os.path.isdir(root):
        raise ConvertError("source directory not found", path=root, hint="--src DIR must hold rank_<N>/ directories")
    epoch, want = _parse_step(step)
    out: dict[int, str] = {}
    for name in sorted(os.listdir(root)):
        m = _RANK_DIR.fullmatch(name)
        path = os.path.join(root, name)
        if m is None or not os.path.isdir(path):
            continue
        files = sorted(
            f for f in os.listdir(path)
            if f.endswith((".ckpt", ".safetensors")) and not f.startswith(".") and os.path.isfile(os.path.join(path, f))
        )
        if not files:
            continue
        if want is not None:
            hits = []
            for f in files:
                sm = _STEP_NAME.search(f)
                if sm and int(sm.group(2)) == want and (epoch is None or int(sm.group(1)) == epoch):
                    hits.append(f)
            if len(hits) != 1:
                what = "no checkpoint" if not hits else f"several checkpoints {hits}"
                raise ConvertError(f"{what} of step {step} in {path} (it holds {files})",
                                   path=path, hint="name the step as EPOCH_STEP if several epochs share a step number")
            files = hits
        elif len(files) > 1:
            steps = sorted({f"{sm.group(1)}_{sm.group(2)}" for f in files if (sm := _STEP_NAME.search(f))})
            raise ConvertError(
                f"{len(files)} checkpoints in {path}: {files}", path=path,
                hint=f"pick one with --step (steps found: {', '.join(steps) or 'none named <prefix>-<epoch>_<step>'})",
            )
        out[int(m.group(1))] = os.path.join(path, files[0])
    if not out:
        raise ConvertError("no rank_<N>/ directory with a checkpoint", path=root,
                           hint="--src DIR must hold rank_<N>/<file>.ckpt (as mindspore.transform_checkpoints expects)")
    return out


def _shard_entry(e: TensorEntry) -> ShardEntry:
    return ShardEntry(e.name, e.dtype, tuple(e.shape), e.nbytes)


def read_inventory(files: Mapping[int, str], key: bytes | None = None) -> list[SourceShard]:
    """Index every source file (headers only) into the planner's input."""
    shards = []
    for rank in sorted(files):
        with open_checkpoint(files[rank], key) as cf:
            if cf.problems:
                raise cf.problems[0]
            shards.append(SourceShard(rank, files[rank], tuple(_shard_entry(e) for e in cf.entries.values())))
    return shards


def _strategy(value: Strategy | str | os.PathLike[str] | None) -> Strategy | None:
    if value is None or isinstance(value, Strategy):
        return value
    return load_strategy(value)


def plan_from_dir(
    src_dir: str | os.PathLike[str],
    src_strategy: Strategy | str | os.PathLike[str] | None,
    dst_strategy: Strategy | str | os.PathLike[str] | None,
    *,
    step: int | str | None = None,
    ranks: Sequence[int] | None = None,
    key: bytes | None = None,
) -> ConversionPlan:
    """Find, index and plan; reads no tensor data."""
    files = find_source_files(src_dir, step)
    return plan_conversion(read_inventory(files, key), _strategy(src_strategy), _strategy(dst_strategy), ranks=ranks)


# --- reading regions -------------------------------------------------------------------------


def _no_release() -> None:
    return None


def payload_view(cf: CheckpointFile, ent: TensorEntry, start: int, length: int) -> tuple[Any, Callable[[], None]]:
    """Payload bytes ``[start, start+length)`` of an entry: a zero-copy view when they lie in one
    segment (+ a function dropping their mapped pages), else a copy (+ a no-op)."""
    pos = 0
    for off, seg_len in ent.segments:
        if pos <= start and start + length <= pos + seg_len:
            absolute = off + start - pos
            release = getattr(cf.source, "release", None)
            if release is None:
                return cf.source.view(absolute, length), _no_release
            return cf.source.view(absolute, length), functools.partial(release, absolute, length)
        pos += seg_len
    return cf.read_range(ent.name, start, length), _no_release


def checked_entry(cf: CheckpointFile, name: str) -> TensorEntry:
    """The entry, refusing one whose payload does not match its dtype and shape."""
    ent = cf.entry(name)
    if ent.nbytes != ent.expected_nbytes():
        raise ConvertError(f"entry {name!r} holds {ent.nbytes} bytes, {ent.dtype}{list(ent.shape)} needs "
                           f"{ent.expected_nbytes()}", path=cf.path)
    return ent


def region_chunks(cf: CheckpointFile, name: str, region: Slice,
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, np.ndarray]]:
    """``(row offset, array)`` pieces of ``region`` of entry ``name``, in C order, dim-0 chunked.

    Only the rows the region spans are read, about ``chunk_bytes`` at a time (at least one row);
    each chunk's mapped pages are dropped once the caller moves on.
    """
    ent = checked_entry(cf, name)
    if not ent.shape:
        dt = numpy_dtype(ent.dtype)
        buf, release = payload_view(cf, ent, 0, dt.itemsize)
        yield 0, np.frombuffer(buf, dtype=dt).reshape(())
        release()
        return
    if region.numel == 0:
        return
    yield from source_rows(cf, ent, region.offsets[0], region.sizes[0], region.index[1:], chunk_bytes)


def source_rows(cf: CheckpointFile, ent: TensorEntry, first: int, rows: int, inner: tuple[slice, ...],
                chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, np.ndarray]]:
    """Rows ``[first, first+rows)`` of an (at least 1-d) entry, ``inner`` applied to the other dims,
    as ``(row offset from first, array)`` chunks of about ``chunk_bytes`` of the source."""
    dt = numpy_dtype(ent.dtype)
    shape = tuple(ent.shape)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
    per = max(1, chunk_bytes // max(row_bytes, 1))
    rest = (slice(None),) + tuple(inner)
    for start in range(first, first + rows, per):
        k = min(per, first + rows - start)
        buf, release = payload_view(cf, ent, start * row_bytes, k * row_bytes)
        arr = np.frombuffer(buf, dtype=dt).reshape((k,) + shape[1:])
        yield start - first, arr[rest]
        del arr, buf
        release()


def hash_update(h: Any, arr: np.ndarray) -> None:
    """Feed ``arr``'s elements in C order (xxh3 streaming = hashing the concatenation)."""
    if arr.size == 0:
        return
    if arr.flags.c_contiguous:
        h.update(arr.reshape(-1).view(np.uint8))
    else:
        h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def region_digest(cf: CheckpointFile, name: str, region: Slice) -> bytes:
    h = xxhash.xxh3_128()
    for _, chunk in region_chunks(cf, name, region):
        hash_update(h, chunk)
    return h.digest()


class OpenSources:
    """Source files opened once and shared by the worker threads."""

    def __init__(self, files: Mapping[int, str], key: bytes | None) -> None:
        self.files, self.key = files, key
        self._open: dict[int, CheckpointFile] = {}
        self._lock = threading.Lock()

    def get(self, rank: int) -> CheckpointFile:
        with self._lock:
            cf = self._open.get(rank)
            if cf is None:
                cf = self._open[rank] = open_checkpoint(self.files[rank], self.key)
            return cf

    def close(self) -> None:
        with self._lock:
            for cf in self._open.values():
                cf.close()
            self._open.clear()
