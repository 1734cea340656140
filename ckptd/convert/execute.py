"""The executor: turn a :class:`~ckptd.convert.plan.ConversionPlan` into verified files, fast.

Per destination rank three threads form a pipeline (the rank's worker is the writer):

  assembler (ckptd/convert/assemble.py)  -- bands of each tensor: zero-copy source views, or
        |                                   pooled buffers filled from source row chunks; hashes
        v   bounded queue                   every piece's source region
  writer (ckptd/convert/writers.py)      -- hashes every piece's destination region of each band
                                            before writing it (ckptd/convert/verify.py: the bytes
                                            in hand, the file is not read back), MindSpore's exact
                                            record bytes; write-back of the file is started as it
                                            grows, one fsync at the end; then the finished file's
                                            index is checked against the plan

so copying, writing and the disk overlap, even for a single destination rank
(``--to-strategy none``). Ranks run in parallel on ``workers`` threads (numpy copies, hashing,
CRCs and file I/O release the GIL). Memory: a few bands (``BAND_BYTES``) per worker, whatever the
tensor or checkpoint sizes (:func:`~ckptd.convert.plan_types.estimate_peak`).

Atomicity. Everything is written under ``OUT/.ckptd-convert-<host>-<pid>-<random>/rank_<r>/``;
only after *every* planned rank is written, fsynced and verified are the rank directories renamed
to ``OUT/rank_<r>`` (``renameat2(RENAME_NOREPLACE)``) and OUT fsynced. Every file and directory
is created, checked and renamed relative to a descriptor of OUT (the caller's, opened beneath the
checkpoint root by :func:`ckptd.confine.open_dir_beneath`; or OUT as given), never by a path
name: a directory swapped for a symlink mid-conversion cannot send a byte elsewhere. A failure removes the temp tree; a SIGKILL leaves only the
hidden temp tree (removed by the next conversion into OUT on the same host) -- never an
``OUT/rank_<r>`` holding a partial or unverified file. Existing ``OUT/rank_<r>`` are never replaced.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal

from ckptd import confine, procs
from ckptd.convert.assemble import ArrayEnd, ArrayStart, BufferSet, Pipeline, Stopped, ValueItem
from ckptd.convert.plan import ConversionPlan, ConvertError, RankPlan
from ckptd.convert.sources import (  # re-exported: callers import them from here
    OpenSources,
    find_source_files,
    plan_from_dir,
    read_inventory,
    region_chunks,
    region_digest,
)
from ckptd.convert.verify import PieceCheck, check_index
from ckptd.convert.writers import Band, CkptWriter, OutFile, SafetensorsWriter, Segments, safetensors_order
from ckptd.errors import CkptdError
from ckptd.format.crypto import EncMode, EncryptingWriter
from ckptd.format.dtypes import STR_TYPE
from ckptd.format.strategy import Strategy

__all__ = [
    "TMP_PREFIX", "ConvertReport", "OutFormat", "RankReport", "convert", "find_source_files", "plan_from_dir",
    "read_inventory", "region_chunks", "region_digest",
]

OutFormat = Literal["ckpt", "safetensors"]
Progress = Callable[[int, int], None]
TMP_PREFIX = ".ckptd-convert-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


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


# --- one destination rank ------------------------------------------------------------------------


def _bands_until_end(items: Iterator[Any], ends: list[ArrayEnd]) -> Iterator[Band]:
    """The bands of the current tensor; its ``ArrayEnd`` goes to ``ends``."""
    for x in items:
        if isinstance(x, ArrayEnd):
            ends.append(x)
            return
        assert isinstance(x, Band)
        yield x


def _write_rank(rp: RankPlan, pipeline: Pipeline, out: OutFile, out_format: OutFormat,
                out_key: bytes | None, tick: Callable[[int], None],
                ) -> tuple[dict[str, Segments], dict[str, Any], int]:
    """Drain the pipeline into the file, checking every tensor's pieces on the bytes in hand
    (:class:`~ckptd.convert.verify.PieceCheck`); returns (where each entry was written, expected
    small values, pieces verified)."""
    enc = EncryptingWriter(out, out_key, EncMode.AES_GCM) if out_key is not None else None  # type: ignore[arg-type]
    writer: CkptWriter | SafetensorsWriter
    if out_format == "safetensors":
        writer = SafetensorsWriter(out, safetensors_order(rp.tasks), crc=True)
    else:
        writer = CkptWriter(enc if enc is not None else out, crc=out_key is None)
    written: dict[str, Segments] = {}
    values: dict[str, Any] = {}
    checked = 0
    items = iter(pipeline)
    for item in items:
        if isinstance(item, ValueItem):
            assert isinstance(writer, CkptWriter)  # convert() refuses strings in safetensors
            written[item.task.name] = writer.write_value(item.task.name, item.value)
            values[item.task.name] = item.value
            continue
        if not isinstance(item, ArrayStart):
            raise ConvertError(f"internal error: unexpected {type(item).__name__} from the assembler")
        task, ends = item.task, []
        check = PieceCheck(task, out.path)
        written[task.name] = writer.write_bands(task, check.bands(_bands_until_end(items, ends)))
        if not ends:
            raise ConvertError(f"internal error: {task.name!r} was not finished by the assembler")
        if task.kind == "rank_id":
            values[task.name] = rp.rank
        checked += check.check(ends[0].digests)
        tick(task.nbytes)
    writer.finish()
    if enc is not None:
        enc.close()
    return written, values, checked


def _convert_rank(rp: RankPlan, sources: OpenSources, tmp_fd: int, tmp_root: str, prefix: str, out_format: OutFormat,
                  out_key: bytes | None, abort: threading.Event, tick: Callable[[int], None],
                  buffer_sets: queue.Queue[BufferSet]) -> RankReport:
    t0 = time.monotonic()
    rank_name = f"rank_{rp.rank}"
    os.mkdir(rank_name, 0o700, dir_fd=tmp_fd)
    rank_fd = os.open(rank_name, _DIR_FLAGS, dir_fd=tmp_fd)
    try:
        ext = "safetensors" if out_format == "safetensors" else "ckpt"
        path = os.path.join(tmp_root, rank_name, f"{prefix}{rp.rank}.{ext}")  # names it in messages only
        order = safetensors_order(rp.tasks) if out_format == "safetensors" else list(rp.tasks)
        buffers = buffer_sets.get()
        out = pipeline = None
        try:
            buffers.prepare(order)
            out = OutFile(path, dir_fd=rank_fd)  # starts write-back as the file grows: the final fsync waits for the tail only
            pipeline = Pipeline(rp.rank, order, sources, buffers, abort)
            written, values, checked = _write_rank(rp, pipeline, out, out_format, out_key, tick)
            out.finish()
            checked += _check_written(out, path, out_key, rp, written, values)
            size = os.fstat(out.fd).st_size
        finally:
            # threads first: nothing may touch the buffers once they are back in the set
            if pipeline is not None:
                pipeline.close()
            if out is not None:
                out.close()
            buffer_sets.put(buffers)
        os.fsync(rank_fd)
    finally:
        os.close(rank_fd)
    return RankReport(rp.rank, path, size, len(rp.tasks), checked, time.monotonic() - t0)


def _check_written(out: OutFile, path: str, out_key: bytes | None, rp: RankPlan, written: dict[str, Segments],
                   values: dict[str, Any]) -> int:
    """``check_index`` of the very file written (its descriptor, reopened read-only), errors naming ``path``."""
    try:
        return check_index(confine.proc_path(out.fd), out_key, rp.tasks, written, values)
    except CkptdError as err:
        if err.path is None or err.path.startswith("/proc/self/fd/"):
            err.path = path
            err.args = (str(err),)
        raise


# --- the whole conversion ------------------------------------------------------------------------


def _clean_stale(out_fd: int) -> None:
    """Remove temp trees of dead converters of this host (a SIGKILLed run leaves its tree)."""
    host = socket.gethostname()
    for name in os.listdir(out_fd):
        m = re.fullmatch(re.escape(TMP_PREFIX) + r"(.+)-(\d+)-[0-9a-f]+", name)
        if m is None or m.group(1) != host:
            continue
        if not procs.alive(int(m.group(2))):
            shutil.rmtree(name, dir_fd=out_fd, ignore_errors=True)  # descriptor-based: never follows a link inside


def open_out_dir(out: str) -> int:
    """OUT as the operator gave it, outside any checkpoint root (a symlink there is their choice)."""
    os.makedirs(out, exist_ok=True)
    return os.open(out, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))


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
    out_fd: int | None = None,
) -> ConvertReport:
    """Re-shard the checkpoints of ``src_dir`` (``rank_<r>/`` directories, or a MindFormers output
    directory: :func:`find_source_files`) into ``out_dir/rank_<r>/<prefix><r>.<ext>``.

    ``src_strategy``/``dst_strategy``: a :class:`Strategy`, a strategy file path, a directory of
    per-rank strategy files, or None (unsharded). A source strategy that does not describe the
    files is refused, with every disagreement, before ``out_dir`` is created. ``ranks`` converts only those destination ranks. ``progress(done, total)`` is
    called (from worker threads) with destination bytes produced so far. Raises
    :class:`ConvertError` (or another :class:`CkptdError`) with nothing renamed into ``out_dir``.
    ``out_fd``: a descriptor of ``out_dir`` the caller opened (and closes): everything is written
    relative to it (:func:`ckptd.confine.open_dir_beneath` below a checkpoint root).
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
    own_fd = out_fd is None
    fd = open_out_dir(out) if out_fd is None else out_fd
    try:
        return _convert_into(plan, out, fd, key, out_key, out_format, prefix, workers, progress, t0)
    finally:
        if own_fd:
            os.close(fd)


def _convert_into(plan: ConversionPlan, out: str, out_fd: int, key: bytes | None, out_key: bytes | None,
                  out_format: OutFormat, prefix: str, workers: int | None, progress: Progress | None,
                  t0: float) -> ConvertReport:
    taken = [f"rank_{r.rank}" for r in plan.ranks if confine.exists_at(out_fd, f"rank_{r.rank}")]
    if taken:
        raise ConvertError(f"refusing to overwrite existing {taken}", path=out,
                           hint="choose an empty output directory or remove those rank directories")
    _clean_stale(out_fd)
    tmp_name = f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp_root = os.path.join(out, tmp_name)
    os.mkdir(tmp_name, 0o700, dir_fd=out_fd)
    tmp_fd = os.open(tmp_name, _DIR_FLAGS, dir_fd=out_fd)
    total = sum(r.bytes_out for r in plan.ranks)
    done = [0]
    lock = threading.Lock()

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            value = done[0]
        if progress is not None:
            progress(value, total)

    sources = OpenSources(plan.src_files, key)
    stop = threading.Event()
    nworkers = max(1, min(workers or min(4, os.cpu_count() or 1), len(plan.ranks) or 1))
    buffer_sets: queue.Queue[BufferSet] = queue.Queue()
    for _ in range(nworkers):
        buffer_sets.put(BufferSet())
    reports: list[RankReport] = []
    try:
        with ThreadPoolExecutor(max_workers=nworkers, thread_name_prefix="ckptd-convert") as pool:
            futs = [pool.submit(_convert_rank, rp, sources, tmp_fd, tmp_root, prefix, out_format, out_key, stop, tick,
                                buffer_sets)
                    for rp in plan.ranks]
            finished, _ = wait(futs, return_when=FIRST_EXCEPTION)
            if any(f.exception() is not None for f in finished):
                stop.set()
                for f in futs:
                    f.cancel()
            wait(futs)
            errors = [e for f in futs if not f.cancelled() and (e := f.exception()) is not None]
            if errors:  # the cause, not the ranks it stopped
                raise next((e for e in errors if not isinstance(e, Stopped)), errors[0])
            reports = [f.result() for f in futs]
        os.fsync(tmp_fd)
        final = []
        for rep in reports:
            name = f"rank_{rep.rank}"
            dest = os.path.join(out, name)
            try:
                confine.rename_noreplace(tmp_fd, name, out_fd, name)
            except FileExistsError:
                raise ConvertError(f"{dest} appeared during the conversion; refusing to replace it", path=dest) from None
            final.append(RankReport(rep.rank, os.path.join(dest, os.path.basename(rep.path)), rep.bytes,
                                    rep.tensors, rep.pieces_verified, rep.seconds))
        os.fsync(out_fd)
    except BaseException:
        stop.set()
        raise
    finally:
        sources.close()
        os.close(tmp_fd)
        shutil.rmtree(tmp_name, dir_fd=out_fd, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.fsync(out_fd)
    if progress is not None:
        progress(total, total)
    return ConvertReport(out, plan, tuple(final), time.monotonic() - t0, out_format, out_key is not None)
