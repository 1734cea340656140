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

Atomicity. Everything is written under ``OUT/.ckptd-convert-<host>-<pid>-<random>/`` (its
``rank_<r>/`` and the target strategy file, when the caller gives one); only after *every* planned
rank is written, fsynced and verified are they renamed into ``OUT`` (``renameat2(RENAME_NOREPLACE)``)
and OUT fsynced; then the set's manifest is written, last (:mod:`ckptd.convert.manifest`: each
file's size and the digest taken while writing it; its rename is the commit). Every file and directory
is created, checked and renamed relative to a descriptor of OUT (a :class:`ckptd.storage.dirs.Dir`:
the caller's, opened beneath the checkpoint root by the confined store; or OUT as given), never by a path
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
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal

import xxhash

from ckptd import procs
from ckptd.convert.assemble import ArrayEnd, ArrayStart, BufferSet, Pipeline, Stopped, ValueItem
from ckptd.convert.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestFile, parse_manifest
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
from ckptd.format.digest import StreamDigest
from ckptd.format.dtypes import STR_TYPE
from ckptd.format.strategy import Strategy
from ckptd.storage import beneath
from ckptd.storage.dirs import Dir

__all__ = [
    "TMP_PREFIX", "ConvertReport", "OutFormat", "RankReport", "convert", "find_source_files", "plan_from_dir",
    "check_strategy_slot", "read_inventory", "region_chunks", "region_digest", "sweep_temp_trees",
    "temp_tree_owner", "undo_commit",
]

OutFormat = Literal["ckpt", "safetensors"]
Progress = Callable[[int, int], None]
TMP_PREFIX = ".ckptd-convert-"


@dataclass(frozen=True)
class RankReport:
    rank: int
    path: str
    bytes: int
    tensors: int
    pieces_verified: int
    seconds: float
    #: xxh3-128 of the file, taken as it was written; its inode and mtime (a rename keeps both)
    digest: str = ""
    mtime_ns: int = 0
    inode: int = 0


@dataclass(frozen=True)
class ConvertReport:
    """What ``convert`` did; every listed file was re-read and verified before it was renamed in."""

    out_dir: str
    plan: ConversionPlan
    ranks: tuple[RankReport, ...]
    seconds: float
    out_format: OutFormat
    encrypted: bool
    #: the committed set's record (every file of OUT it commits, earlier ranks' included)
    manifest: Manifest | None = None
    #: the names this conversion created in OUT (rank directories, the strategy file unless the
    #: same bytes were there already): what a caller that cannot catalogue the set removes
    created: tuple[str, ...] = ()
    #: the manifest OUT held before (a set of other ranks committed there): what undoing this set
    #: puts back (:func:`undo_commit`)
    earlier_manifest: bytes | None = None

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


def _convert_rank(rp: RankPlan, sources: OpenSources, tmp: Dir, prefix: str, out_format: OutFormat,
                  out_key: bytes | None, abort: threading.Event, tick: Callable[[int], None],
                  buffer_sets: queue.Queue[BufferSet]) -> RankReport:
    t0 = time.monotonic()
    rank_name = f"rank_{rp.rank}"
    with tmp.mkdir(rank_name) as rank_dir:
        ext = "safetensors" if out_format == "safetensors" else "ckpt"
        path = rank_dir.child(f"{prefix}{rp.rank}.{ext}")  # names it in messages only
        order = safetensors_order(rp.tasks) if out_format == "safetensors" else list(rp.tasks)
        buffers = buffer_sets.get()
        out = pipeline = None
        try:
            buffers.prepare(order)
            out = OutFile(path, dir_fd=rank_dir.fd)  # starts write-back as the file grows: the final fsync waits for the tail only
            pipeline = Pipeline(rp.rank, order, sources, buffers, abort)
            written, values, checked = _write_rank(rp, pipeline, out, out_format, out_key, tick)
            out.finish()
            checked += _check_written(out, path, out_key, rp, written, values)
            st = os.fstat(out.fd)
            # safetensors' header is rewritten in place once its CRC is known: only then is the
            # file read back for its digest (from the page cache, moments after it was written)
            digest = out.digest() or StreamDigest().finish(beneath.proc_path(out.fd))
        finally:
            # threads first: nothing may touch the buffers once they are back in the set
            if pipeline is not None:
                pipeline.close()
            if out is not None:
                out.close()
            buffer_sets.put(buffers)
        rank_dir.fsync()
    return RankReport(rp.rank, path, st.st_size, len(rp.tasks), checked, time.monotonic() - t0, digest,
                      st.st_mtime_ns, st.st_ino)


def _check_written(out: OutFile, path: str, out_key: bytes | None, rp: RankPlan, written: dict[str, Segments],
                   values: dict[str, Any]) -> int:
    """``check_index`` of the very file written (its descriptor, reopened read-only), errors naming ``path``."""
    try:
        return check_index(beneath.proc_path(out.fd), out_key, rp.tasks, written, values)
    except CkptdError as err:
        if err.path is None or err.path.startswith("/proc/self/fd/"):
            err.path = path
            err.args = (str(err),)
        raise


# --- the whole conversion ------------------------------------------------------------------------


_TMP_NAME = re.compile(re.escape(TMP_PREFIX) + r"(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]+")


def temp_tree_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of the converter whose temp tree ``name`` is (None: not a temp tree's name)."""
    m = _TMP_NAME.fullmatch(name)
    return (m["host"], int(m["pid"])) if m else None


def dead_here(host: str, pid: int) -> bool:
    """A temp tree's owner is a process of this host that no longer runs (a SIGKILLed converter)."""
    return host == socket.gethostname() and not procs.alive(pid)


def sweep_temp_trees(out: Dir, wanted: Callable[[str, int], bool] = dead_here) -> tuple[list[str], list[str]]:
    """Remove the temp trees in the directory ``out`` whose owner ``wanted(host, pid)`` picks:
    (names removed, refusals with their reasons). The one cleaner of abandoned conversions: each
    conversion runs it on its output directory before writing, and the daemon on the output
    directories of conversions it failed as abandoned. Descriptor-based throughout (``rmtree``
    with ``dir_fd`` never follows a link inside the tree; a symlink named like a tree is refused)."""
    removed: list[str] = []
    refused: list[str] = []
    for name in out.names():
        owner = temp_tree_owner(name)
        if owner is None or not wanted(*owner):
            continue
        try:
            out.is_real_dir(name)  # not a link to one
            out.remove_tree(name)
            removed.append(name)
        except FileNotFoundError:
            pass  # removed meanwhile (another daemon on a shared root)
        except beneath.ConfinementError as err:
            refused.append(f"{name}: not a directory ({err.message}); left alone")
        except OSError as err:
            refused.append(f"{name}: cannot remove it ({err.strerror or err}); left alone")
    return removed, refused


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
    out_handle: Dir | None = None,
    strategy_file: tuple[str, bytes] | None = None,
) -> ConvertReport:
    """Re-shard the checkpoints of ``src_dir`` (``rank_<r>/`` directories, or a MindFormers output
    directory: :func:`find_source_files`) into ``out_dir/rank_<r>/<prefix><r>.<ext>``.

    ``src_strategy``/``dst_strategy``: a :class:`Strategy`, a strategy file path, a directory of
    per-rank strategy files, or None (unsharded). A source strategy that does not describe the
    files is refused, with every disagreement, before ``out_dir`` is created. ``ranks`` converts only those destination ranks. ``progress(done, total)`` is
    called (from worker threads) with destination bytes produced so far. Raises
    :class:`ConvertError` (or another :class:`CkptdError`) with nothing renamed into ``out_dir``.
    ``out_handle``: ``out_dir`` as the caller opened it (and closes it): everything is written
    relative to its descriptor (:meth:`ckptd.storage.PosixStorage.open_dir` below a checkpoint root).
    ``strategy_file``: ``(name, bytes)`` of the target strategy file, written into ``out_dir`` as
    part of the set (one already there with other bytes is refused before anything is written).
    The set is committed by its manifest, written last (:mod:`ckptd.convert.manifest`).
    """
    t0 = time.monotonic()
    if out_format not in ("ckpt", "safetensors"):
        raise ConvertError(f"unknown output format {out_format!r}", hint="use ckpt or safetensors")
    if out_key is not None and out_format == "safetensors":
        raise ConvertError("safetensors output cannot be encrypted", hint="drop --out-key-file or use --format ckpt")
    if not prefix or os.sep in prefix or prefix.startswith("."):
        raise ConvertError(f"invalid file prefix {prefix!r}", hint="a plain file-name prefix such as checkpoint_")
    if strategy_file is not None and (os.sep in strategy_file[0] or strategy_file[0].startswith(".")
                                      or strategy_file[0] == MANIFEST_NAME):
        raise ConvertError(f"invalid strategy file name {strategy_file[0]!r}", hint="a plain file name")
    if plan is None:
        plan = plan_from_dir(src_dir, src_strategy, dst_strategy, step=step, ranks=ranks, key=key)
    if out_format == "safetensors":
        bad = sorted({t.name for r in plan.ranks for t in r.tasks if t.dtype == STR_TYPE})
        if bad:
            raise ConvertError(f"string entries {bad} cannot be stored in safetensors", hint="use --format ckpt")
    out = os.path.abspath(os.fspath(out_dir))
    with Dir.open_given(out) if out_handle is None else contextlib.nullcontext(out_handle) as out_dir_:
        return _convert_into(plan, out_dir_, key, out_key, out_format, prefix, workers, progress, t0, strategy_file)


def check_strategy_slot(out: Dir, name: str, content: bytes) -> bool:
    """Whether ``OUT/name`` already holds exactly ``content`` (a copy converted before); False when
    absent. Anything else there -- other bytes, a planted symlink, FIFO or hard link -- is refused:
    never read into a catalog, followed, or replaced."""
    if not out.exists(name):
        return False
    if out.read(name, len(content)) != content:
        raise CkptdError("holds another strategy than this conversion's target; not replaced", path=out.child(name),
                         hint="remove it (after checking where it came from) and convert again")
    return True


def _earlier_manifest(out: Dir) -> tuple[Manifest | None, bytes | None]:
    """The manifest of a set committed in OUT before, and its bytes (ranks this conversion does not
    write keep their entries); a manifest that is not ckptd's is refused before anything is written."""
    if not out.exists(MANIFEST_NAME):
        return None, None
    data = out.read(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    return parse_manifest(data, out.child(MANIFEST_NAME)), data


def undo_commit(out: Dir, created: Sequence[str], earlier_manifest: bytes | None) -> None:
    """Take back a set renamed into OUT: the commit record first (the earlier set's manifest put
    back, or none), so nothing there ever claims files that are being removed; then what the set
    created. Through the descriptor: a symlink planted in its place is never followed."""
    with contextlib.suppress(OSError, CkptdError):
        if earlier_manifest is not None:
            with out.create(MANIFEST_NAME, overwrite=True) as fh:
                fh.write(earlier_manifest)
        else:
            out.unlink(MANIFEST_NAME)
    for name in created:
        with contextlib.suppress(OSError):
            if name.startswith("rank_"):
                out.remove_tree(name)
            else:
                out.unlink(name)


def _convert_into(plan: ConversionPlan, out_dir: Dir, key: bytes | None, out_key: bytes | None,
                  out_format: OutFormat, prefix: str, workers: int | None, progress: Progress | None,
                  t0: float, strategy_file: tuple[str, bytes] | None) -> ConvertReport:
    out = out_dir.path
    taken = [f"rank_{r.rank}" for r in plan.ranks if out_dir.exists(f"rank_{r.rank}")]
    if taken:
        raise ConvertError(f"refusing to overwrite existing {taken}", path=out,
                           hint="choose an empty output directory or remove those rank directories")
    if strategy_file is not None:
        check_strategy_slot(out_dir, *strategy_file)
    earlier, earlier_bytes = _earlier_manifest(out_dir)
    sweep_temp_trees(out_dir)
    tmp_name = f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp = out_dir.mkdir(tmp_name)
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
    final: list[RankReport] = []
    created: list[str] = []  # names renamed into OUT by this conversion
    try:
        with ThreadPoolExecutor(max_workers=nworkers, thread_name_prefix="ckptd-convert") as pool:
            futs = [pool.submit(_convert_rank, rp, sources, tmp, prefix, out_format, out_key, stop, tick,
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
        if strategy_file is not None:
            with tmp.create(strategy_file[0]) as fh:
                fh.write(strategy_file[1])
        tmp.fsync()
        for rep in reports:
            name = f"rank_{rep.rank}"
            dest = os.path.join(out, name)
            try:
                tmp.move_into(name, out_dir)
            except FileExistsError:
                raise ConvertError(f"{dest} appeared during the conversion; refusing to replace it", path=dest) from None
            created.append(name)
            final.append(RankReport(rep.rank, os.path.join(dest, os.path.basename(rep.path)), rep.bytes,
                                    rep.tensors, rep.pieces_verified, rep.seconds, rep.digest, rep.mtime_ns,
                                    rep.inode))
        files = [ManifestFile(os.path.relpath(r.path, out), r.rank, r.bytes, r.digest) for r in final]
        if strategy_file is not None:
            name, content = strategy_file
            try:
                tmp.move_into(name, out_dir)
                created.append(name)
            except FileExistsError:  # there already: the same bytes (a copy converted before), or refused
                check_strategy_slot(out_dir, name, content)
            files.append(ManifestFile(name, None, len(content), xxhash.xxh3_128_hexdigest(content)))
        out_dir.fsync()
        manifest = Manifest(tuple(files), out_format, out_key is not None, plan.src_strategy_hash,
                            plan.dst_strategy_hash).merged(earlier)
        with out_dir.create(MANIFEST_NAME, overwrite=True) as fh:  # the commit
            fh.write(manifest.to_json())
    except BaseException:
        stop.set()
        if created:  # renamed in, maybe committed (the directory's fsync failed): nothing that looks finished stays
            undo_commit(out_dir, created, earlier_bytes)
        raise
    finally:
        sources.close()
        tmp.close()
        with contextlib.suppress(OSError):
            out_dir.remove_tree(tmp_name)
        with contextlib.suppress(OSError):
            out_dir.fsync()
    if progress is not None:
        progress(total, total)
    return ConvertReport(out, plan, tuple(final), time.monotonic() - t0, out_format, out_key is not None, manifest,
                         tuple(created), earlier_bytes)
