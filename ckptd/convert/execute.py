"""The streaming executor: turn a :class:`~ckptd.convert.plan.ConversionPlan` into verified files.

Memory. A destination rank is produced one tensor at a time: allocate that tensor's slice, copy
every planned piece into it from zero-copy views of the (mmap'd or decrypting) sources, reading
source rows in chunks of ``CHUNK_BYTES`` and dropping each chunk's mapped pages afterwards, hand
the slice to the streaming writer, drop it. Peak extra memory per worker is therefore about the
largest destination slice plus two chunks, whatever the checkpoint size; workers run over
destination ranks (threads: numpy copies, hashing and file I/O release the GIL).

Verification. While copying, each piece's source region is hashed (xxh3-128, C order). After the
file is written and fsynced it is re-opened like any reader would (decrypting if encrypted), its
entries are checked against the plan (names, dtypes, shapes) and every piece's region of the
output is hashed again: any mismatch (writer bug, disk, wrong plan application) fails the rank.

Atomicity. Everything is written under ``OUT/.ckptd-convert-<host>-<pid>-<random>/rank_<r>/``;
only after *every* planned rank is written and verified are the rank directories renamed to
``OUT/rank_<r>`` and OUT fsynced. A failure removes the temp tree; a SIGKILL leaves only the
hidden temp tree (removed by the next conversion into OUT on the same host) -- never an
``OUT/rank_<r>`` holding a partial or unverified file. Existing ``OUT/rank_<r>`` are never replaced.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import struct
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

import numpy as np
import xxhash

from ckptd.convert.plan import (
    CHUNK_BYTES,
    ConversionPlan,
    ConvertError,
    RankPlan,
    ShardEntry,
    SourceShard,
    TensorTask,
    plan_conversion,
)
from ckptd.format import safetensors_format as st_fmt
from ckptd.format.atomic import atomic_write, fsync_dir
from ckptd.format.checkpoint import CheckpointFile, open_checkpoint, write_checkpoint
from ckptd.format.ckpt import TypedArray
from ckptd.format.crc import crc32, crc32_combine
from ckptd.format.dtypes import STR_TYPE, numpy_dtype, safetensors_name
from ckptd.format.entry import TensorEntry
from ckptd.format.layout import Slice
from ckptd.format.strategy import Strategy, load_strategy

OutFormat = Literal["ckpt", "safetensors"]
Progress = Callable[[int, int], None]
TMP_PREFIX = ".ckptd-convert-"
_STEP_NAME = re.compile(r"-(\d+)_(\d+)\.(?:ckpt|safetensors)$")
_RANK_DIR = re.compile(r"rank_(0|[1-9][0-9]*)")


@dataclass(frozen=True)
class RankReport:
    rank: int
    path: str
    bytes: int
    tensors: int
    pieces_verified: int
    seconds: float


@dataclass(frozen=True)
class ConvertReport:
    """What ``convert`` did; every listed file was re-read and verified before it was renamed in."""

    out_dir: str
    plan: ConversionPlan
    ranks: tuple[RankReport, ...]
    seconds: float
    out_format: OutFormat
    encrypted: bool

    @property
    def bytes_written(self) -> int:
        return sum(r.bytes for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out_dir": self.out_dir,
            "format": self.out_format,
            "encrypted": self.encrypted,
            "seconds": round(self.seconds, 3),
            "bytes_written": self.bytes_written,
            "verified": True,
            "src_strategy_hash": self.plan.src_strategy_hash,
            "dst_strategy_hash": self.plan.dst_strategy_hash,
            "notes": list(self.plan.notes),
            "ranks": [r.__dict__ for r in self.ranks],
        }


# --- finding and indexing the sources ----------------------------------------------------------


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


# --- reading regions ---------------------------------------------------------------------------


def _rows(cf: CheckpointFile, ent: TensorEntry, start: int, length: int) -> tuple[Any, Callable[[], None]]:
    """Payload bytes ``[start, start+length)`` of an entry: a zero-copy view when they lie in one
    segment (+ a function dropping their mapped pages), else a copy."""
    pos = 0
    for off, seg_len in ent.segments:
        if pos <= start and start + length <= pos + seg_len:
            absolute = off + start - pos
            release = getattr(cf.source, "release", None)
            return cf.source.view(absolute, length), (lambda: release(absolute, length)) if release else (lambda: None)
        pos += seg_len
    return cf.read_range(ent.name, start, length), lambda: None


def region_chunks(cf: CheckpointFile, name: str, region: Slice, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, np.ndarray]]:
    """``(row offset, array)`` pieces of ``region`` of entry ``name``, in C order, dim-0 chunked.

    Only the rows the region spans are read, about ``chunk_bytes`` at a time (at least one row).
    """
    ent = cf.entry(name)
    dt = numpy_dtype(ent.dtype)
    shape = tuple(ent.shape)
    if ent.nbytes != ent.expected_nbytes():
        raise ConvertError(f"entry {name!r} holds {ent.nbytes} bytes, {ent.dtype}{list(shape)} needs "
                           f"{ent.expected_nbytes()}", path=cf.path)
    if not shape:
        buf, release = _rows(cf, ent, 0, dt.itemsize)
        yield 0, np.frombuffer(buf, dtype=dt).reshape(())
        release()
        return
    if region.numel == 0:
        return
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
    r0, n = region.offsets[0], region.sizes[0]
    per = max(1, chunk_bytes // max(row_bytes, 1))
    rest = (slice(None),) + region.index[1:]
    for first in range(r0, r0 + n, per):
        k = min(per, r0 + n - first)
        buf, release = _rows(cf, ent, first * row_bytes, k * row_bytes)
        arr = np.frombuffer(buf, dtype=dt).reshape((k,) + shape[1:])
        yield first - r0, arr[rest]
        del arr, buf
        release()


def _hash_update(h: Any, arr: np.ndarray) -> None:
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.size:
        h.update(flat.view(np.uint8))


def region_digest(cf: CheckpointFile, name: str, region: Slice) -> bytes:
    h = xxhash.xxh3_128()
    for _, chunk in region_chunks(cf, name, region):
        _hash_update(h, chunk)
    return h.digest()


# --- per-rank work -----------------------------------------------------------------------------


class _Sources:
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


@dataclass
class _Expect:
    """What the output must hold for one task: piece digests (or the value of str/rank_id)."""

    task: TensorTask
    digests: list[bytes]
    value: Any = None


def _rank_id_value(task: TensorTask, rank: int) -> Any:
    if task.dtype == STR_TYPE:
        return str(rank)
    return TypedArray(task.dtype, np.full(task.dst_slice.sizes, rank, dtype=numpy_dtype(task.dtype)))


class _Scratch(threading.local):
    """One reusable destination buffer per worker thread.

    Fresh allocations of large arrays cost a page fault per 4 KiB page on first touch (~3 ms per
    MiB on small VMs, more than the copy itself); reusing one buffer, grown to the largest slice,
    pays that once per worker. The writers copy or write a slice before asking for the next one.
    """

    buf: np.ndarray | None = None

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.buf is None or self.buf.nbytes < nbytes:
            self.buf = None  # drop the old one before allocating the bigger one
            self.buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        return self.buf[:nbytes].view(dtype).reshape(shape)


def _produce(rp: RankPlan, tasks: Sequence[TensorTask], sources: _Sources, expects: list[_Expect],
             stop: threading.Event, tick: Callable[[int], None], scratch: _Scratch) -> Iterator[tuple[str, Any]]:
    """Yield (name, value) for the writer in ``tasks`` order, one destination tensor alive at a time."""
    for task in tasks:
        if stop.is_set():
            raise ConvertError("conversion aborted because another rank failed")
        if task.kind == "rank_id":
            value = _rank_id_value(task, rp.rank)
            expects.append(_Expect(task, [], str(rp.rank) if task.dtype == STR_TYPE else rp.rank))
            yield task.name, value
            continue
        if task.dtype == STR_TYPE:
            text = sources.get(task.pieces[0].src_rank).value(task.name)
            expects.append(_Expect(task, [], text))
            yield task.name, text
            continue
        buf = scratch.array(task.dst_slice.sizes, numpy_dtype(task.dtype))
        digests = []
        target = buf
        for piece in task.pieces:
            cf = sources.get(piece.src_rank)
            target = buf[piece.dst_region.index + (Ellipsis,)]
            h = xxhash.xxh3_128()
            for off, chunk in region_chunks(cf, task.name, piece.src_region):
                if chunk.ndim:
                    target[off : off + chunk.shape[0]] = chunk
                else:
                    target[...] = chunk
                _hash_update(h, chunk)
            digests.append(h.digest())
        expects.append(_Expect(task, digests))
        yield task.name, TypedArray(task.dtype, buf)
        del buf, target
        tick(task.nbytes)


def _verify(path: str, rp: RankPlan, expects: list[_Expect], key: bytes | None) -> int:
    """Re-read the written file and check it against the plan and the source digests."""
    checked = 0
    with open_checkpoint(path, key) as cf:
        if cf.problems:
            raise ConvertError(f"output file does not index cleanly: {cf.problems[0].message}", path=path)
        names = [t.name for t in rp.tasks]
        if sorted(cf.entries) != sorted(names):
            raise ConvertError(f"output holds entries {sorted(cf.entries)} instead of {sorted(names)}", path=path)
        for exp in expects:
            task = exp.task
            ent = cf.entry(task.name)
            want_shape = task.dst_slice.sizes if task.dtype != STR_TYPE else ent.shape
            if ent.dtype != task.dtype or tuple(ent.shape) != tuple(want_shape):
                raise ConvertError(f"entry {task.name!r} is {ent.dtype}{list(ent.shape)} instead of "
                                   f"{task.dtype}{list(want_shape)}", path=path)
            if exp.value is not None:
                got = cf.value(task.name)
                if (got.item() if isinstance(got, np.ndarray) and got.size == 1 else got) != exp.value:
                    raise ConvertError(f"entry {task.name!r} reads back as {got!r} instead of {exp.value!r}", path=path)
                checked += 1
                continue
            for piece, digest in zip(task.pieces, exp.digests):
                if region_digest(cf, task.name, piece.dst_region) != digest:
                    raise ConvertError(
                        f"verification failed: {task.name!r} region {list(piece.dst_region.offsets)}+"
                        f"{list(piece.dst_region.sizes)} differs from source rank {piece.src_rank}", path=path,
                        hint="the output was not written correctly (disk or memory error?); nothing was renamed into place",
                    )
                checked += 1
    return checked


def _st_order(rp: RankPlan) -> list[TensorTask]:
    """safetensors' data order: descending dtype alignment rank, then name."""
    return sorted(rp.tasks, key=lambda t: (-st_fmt._ST_DTYPE_RANK[safetensors_name(t.dtype)], t.name.encode()))


def _write_safetensors(path: str, items: Iterator[tuple[str, Any]], tasks: list[TensorTask], crc: bool) -> None:
    """Stream a MindSpore-style safetensors file (``items`` come in ``tasks`` = file order).

    The header goes first but ``crc_num`` (over sorted names) is only known at the end: the
    header is reserved at the size it has with the longest possible value and rewritten in place,
    padded with spaces (JSON whitespace, as safetensors itself pads), so the data never moves.
    """
    layout, pos = [], 0
    for t in tasks:
        layout.append((t.name, safetensors_name(t.dtype), tuple(t.dst_slice.sizes), pos, pos + t.nbytes))
        pos += t.nbytes
    meta = {"format": "ms"} if tasks else None
    with_crc = bool(meta) and crc
    reserved = st_fmt.encode_header({**meta, "crc_num": "4294967295"} if with_crc else meta, layout)  # type: ignore[dict-item]
    produced: dict[str, tuple[int, int, np.ndarray | None]] = {}
    with atomic_write(path) as fh:
        fh.write(struct.pack("<Q", len(reserved)))
        fh.write(reserved)
        for task, (name, value) in zip(tasks, items):
            assert name == task.name
            arr = value.data if isinstance(value, TypedArray) else np.asarray(value)
            raw = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
            fh.write(memoryview(raw))
            produced[name] = (crc32(memoryview(raw)) if with_crc else 0, raw.size, arr.copy() if arr.ndim == 0 else None)
            del value, arr, raw
        if with_crc:
            value_crc = 0
            dtypes = {t.name: t.dtype for t in tasks}
            for name in sorted(produced, key=lambda s: s.encode()):
                dcrc, length, scalar = produced[name]
                value_crc = crc32(name.encode(), value_crc)
                if scalar is not None and dtypes[name] in st_fmt._INDEX_QUIRK_DTYPES:
                    value_crc = st_fmt.crc32_zeros(value_crc, st_fmt._scalar_index(dtypes[name], scalar.tobytes(), name))
                else:
                    value_crc = crc32_combine(value_crc, dcrc, length)
            header = st_fmt.encode_header({**meta, "crc_num": str(value_crc)}, layout)  # type: ignore[dict-item]
            fh.seek(8)
            fh.write(header + b" " * (len(reserved) - len(header)))


def _convert_rank(rp: RankPlan, sources: _Sources, tmp_root: str, prefix: str, out_format: OutFormat,
                  out_key: bytes | None, stop: threading.Event, tick: Callable[[int], None],
                  scratch: _Scratch) -> RankReport:
    t0 = time.monotonic()
    rank_dir = os.path.join(tmp_root, f"rank_{rp.rank}")
    os.mkdir(rank_dir, 0o700)
    ext = "safetensors" if out_format == "safetensors" else "ckpt"
    path = os.path.join(rank_dir, f"{prefix}{rp.rank}.{ext}")
    expects: list[_Expect] = []
    if out_format == "safetensors":
        order = _st_order(rp)
        _write_safetensors(path, _produce(rp, order, sources, expects, stop, tick, scratch), order, crc=True)
    else:
        items = _produce(rp, rp.tasks, sources, expects, stop, tick, scratch)
        write_checkpoint(path, items, crc=out_key is None, enc_key=out_key)
    checked = _verify(path, rp, expects, out_key)
    fsync_dir(rank_dir)
    return RankReport(rp.rank, path, os.path.getsize(path), len(rp.tasks), checked, time.monotonic() - t0)


# --- the whole conversion ------------------------------------------------------------------------


def _clean_stale(out: str) -> None:
    """Remove temp trees of dead converters of this host (a SIGKILLed run leaves its tree)."""
    host = socket.gethostname()
    for name in os.listdir(out):
        m = re.fullmatch(re.escape(TMP_PREFIX) + r"(.+)-(\d+)-[0-9a-f]+", name)
        if m is None or m.group(1) != host:
            continue
        try:
            os.kill(int(m.group(2)), 0)
            continue  # still running
        except ProcessLookupError:
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        except PermissionError:
            continue


def convert(
    src_dir: str | os.PathLike[str],
    src_strategy: Strategy | str | os.PathLike[str] | None,
    dst_strategy: Strategy | str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    *,
    step: int | str | None = None,
    ranks: Sequence[int] | None = None,
    workers: int | None = None,
    key: bytes | None = None,
    out_key: bytes | None = None,
    out_format: OutFormat = "ckpt",
    prefix: str = "checkpoint_",
    progress: Progress | None = None,
    plan: ConversionPlan | None = None,
) -> ConvertReport:
    """Re-shard the checkpoints of ``src_dir/rank_<r>/`` into ``out_dir/rank_<r>/<prefix><r>.<ext>``.

    ``src_strategy``/``dst_strategy``: a :class:`Strategy`, a strategy file path, or None
    (unsharded). ``ranks`` converts only those destination ranks. ``progress(done, total)`` is
    called (from worker threads) with destination bytes produced so far. Raises
    :class:`ConvertError` (or another :class:`CkptdError`) with nothing renamed into ``out_dir``.
    """
    t0 = time.monotonic()
    if out_format not in ("ckpt", "safetensors"):
        raise ConvertError(f"unknown output format {out_format!r}", hint="use ckpt or safetensors")
    if out_key is not None and out_format == "safetensors":
        raise ConvertError("safetensors output cannot be encrypted", hint="drop --out-key-file or use --format ckpt")
    if not prefix or os.sep in prefix or prefix.startswith("."):
        raise ConvertError(f"invalid file prefix {prefix!r}", hint="a plain file-name prefix such as checkpoint_")
    if plan is None:
        plan = plan_from_dir(src_dir, src_strategy, dst_strategy, step=step, ranks=ranks, key=key)
    if out_format == "safetensors":
        bad = sorted({t.name for r in plan.ranks for t in r.tasks if t.dtype == STR_TYPE})
        if bad:
            raise ConvertError(f"string entries {bad} cannot be stored in safetensors", hint="use --format ckpt")
    out = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out, exist_ok=True)
    taken = [f"rank_{r.rank}" for r in plan.ranks if os.path.lexists(os.path.join(out, f"rank_{r.rank}"))]
    if taken:
        raise ConvertError(f"refusing to overwrite existing {taken}", path=out,
                           hint="choose an empty output directory or remove those rank directories")
    _clean_stale(out)
    tmp_root = os.path.join(out, f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp_root, 0o700)
    total = sum(r.bytes_out for r in plan.ranks)
    done = [0]
    lock = threading.Lock()

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            value = done[0]
        if progress is not None:
            progress(value, total)

    sources = _Sources(plan.src_files, key)
    stop = threading.Event()
    scratch = _Scratch()
    nworkers = max(1, min(workers or min(4, os.cpu_count() or 1), len(plan.ranks) or 1))
    reports: list[RankReport] = []
    try:
        with ThreadPoolExecutor(max_workers=nworkers, thread_name_prefix="ckptd-convert") as pool:
            futs = [pool.submit(_convert_rank, rp, sources, tmp_root, prefix, out_format, out_key, stop, tick, scratch)
                    for rp in plan.ranks]
            finished, _ = wait(futs, return_when=FIRST_EXCEPTION)
            if any(f.exception() is not None for f in finished):
                stop.set()
                for f in futs:
                    f.cancel()
            wait(futs)
            for f in futs:
                if f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            reports = [f.result() for f in futs]
        fsync_dir(tmp_root)
        final = []
        for rep in reports:
            src = os.path.join(tmp_root, f"rank_{rep.rank}")
            dest = os.path.join(out, f"rank_{rep.rank}")
            if os.path.lexists(dest):
                raise ConvertError(f"{dest} appeared during the conversion; refusing to replace it", path=dest)
            os.rename(src, dest)
            final.append(RankReport(rep.rank, os.path.join(dest, os.path.basename(rep.path)), rep.bytes,
                                    rep.tensors, rep.pieces_verified, rep.seconds))
        fsync_dir(out)
    except BaseException:
        stop.set()
        raise
    finally:
        sources.close()
        shutil.rmtree(tmp_root, ignore_errors=True)
        with contextlib.suppress(OSError):
            fsync_dir(out)
    if progress is not None:
        progress(total, total)
    return ConvertReport(out, plan, tuple(final), time.monotonic() - t0, out_format, out_key is not None)
