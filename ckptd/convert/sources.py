"""Finding, indexing and reading the source checkpoints of a conversion.

``find_source_files`` maps the rank directories of a source to one file each; ``read_inventory``
indexes them (headers, plus a digest of each tensor's first bytes) into the planner's input;
``row_views`` hands out the rows of a source entry as zero-copy views of the mmap'd (or
decrypting) file, each with a function dropping the mapped pages once used, so reading adds only
about one chunk to the process's resident memory whatever the file size.

A source is a directory of ``rank_<r>/`` (what ``mindspore.transform_checkpoints`` reads, and what
ckptd writes) or a MindFormers output directory (``<out>`` or ``<out>/checkpoint``, whose
``rank_<r>/`` hold ``{P}_rank_<r>[_k]-{E}_{S}.ckpt``, ``meta.json`` and breakpoint saves). Which
directories and names are checkpoints is :mod:`ckptd.runlayout`'s knowledge (``detect``, a layout's
``rank_dirs``, ``parse_shard_name``); this module only picks among them:

* ``meta.json`` and other non-checkpoint files are never sources; breakpoint saves
  (``..._breakpoint.ckpt``, written by MindFormers' exception handler in the middle of a step)
  are sources only when ``--step`` names one (``E_S_breakpoint``), never by default;
* a rank directory holding several checkpoints needs ``--step`` -- file-name order or mtime never
  decides -- and ``--step`` may carry the save's prefix (``PREFIX-E_S``: the rank tag dropped, the
  restart suffix ``_k`` kept) to choose between two incarnations that saved the same step;
* the files picked must all be of one save (same prefix, epoch, step): a mix is refused.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ckptd import runlayout
from ckptd.convert.consistency import PROBE_BYTES, ranks_text, repeats_one_element
from ckptd.convert.plan import CHUNK_BYTES, ConversionPlan, ConvertError, ShardEntry, SourceShard, plan_conversion
from ckptd.errors import CkptdError
from ckptd.format.checkpoint import CheckpointFile, open_checkpoint
from ckptd.format.dtypes import MS_DTYPES, itemsize, numpy_dtype
from ckptd.format.entry import TensorEntry
from ckptd.format.layout import Slice
from ckptd.format.strategy import Strategy, load_strategy

_STEP_ARG = re.compile(r"(?:(?P<prefix>.+)-)?(?:(?P<epoch>0|[1-9][0-9]*)_)?(?P<step>0|[1-9][0-9]*)(?P<bp>_breakpoint)?")
STEP_SYNTAX = "[PREFIX-][EPOCH_]STEP[_breakpoint]"
_MAX_LISTED = 20


# --- finding -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepChoice:
    """What ``--step`` asks for: ``[PREFIX-][EPOCH_]STEP[_breakpoint]`` (``200``, ``2_200``,
    ``llama_1-2_200``, ``2_200_breakpoint``); unset parts match anything."""

    text: str
    step: int
    epoch: int | None = None
    prefix: str | None = None
    breakpoint: bool = False

    def matches(self, save: "Save") -> bool:
        return (save.step == self.step and save.breakpoint == self.breakpoint
                and (self.epoch is None or save.epoch == self.epoch)
                and (self.prefix is None or save.prefix == self.prefix))


@dataclass(frozen=True)
class Save:
    """A checkpoint's save identity across ranks, from runlayout's reading of its name."""

    prefix: str
    epoch: int
    step: int
    breakpoint: bool

    def label(self) -> str:
        """The ``--step`` text that picks exactly this save."""
        return f"{self.prefix}-{self.epoch}_{self.step}" + ("_breakpoint" if self.breakpoint else "")


@dataclass(frozen=True)
class _File:
    name: str
    path: str
    save: Save | None  # None: not a ``<prefix>-<epoch>_<step>`` name (e.g. ckptd's own outputs)

    @property
    def is_breakpoint(self) -> bool:
        return self.save is not None and self.save.breakpoint


def parse_step(step: int | str | None) -> StepChoice | None:
    if step is None:
        return None
    text = str(step)
    m = _STEP_ARG.fullmatch(text)
    if m is None:
        raise ConvertError(f"--step {text!r} is not {STEP_SYNTAX}",
                           hint="e.g. --step 200, --step 2_200, --step llama_1-2_200 or --step 2_200_breakpoint")
    return StepChoice(text, int(m.group("step")), int(m.group("epoch")) if m.group("epoch") else None,
                      m.group("prefix"), bool(m.group("bp")))


def _rank_files(rank: int, path: str) -> list[_File]:
    out = []
    for name in sorted(os.listdir(path)):
        if name.startswith("."):
            continue
        parsed = runlayout.parse_shard_name(name, rank)
        if parsed is None and not name.endswith(runlayout.SHARD_SUFFIXES):
            continue  # meta.json, .done sidecars, in-flight temp files, ...
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        save = Save(parsed[0], parsed[1], parsed[2], parsed[3]) if parsed is not None else None
        out.append(_File(name, full, save))
    return out


def _labels(files: Sequence[_File]) -> list[str]:
    """The shortest ``--step`` text for each save among ``files`` (prefix and epoch only if needed)."""
    saves = sorted({f.save for f in files if f.save is not None},
                   key=lambda s: (s.epoch, s.step, s.prefix, s.breakpoint))
    out = []
    for s in saves:
        prefixes = {t.prefix for t in saves if (t.epoch, t.step, t.breakpoint) == (s.epoch, s.step, s.breakpoint)}
        out.append(s.label() if len(prefixes) > 1 else f"{s.epoch}_{s.step}" + ("_breakpoint" if s.breakpoint else ""))
    return list(dict.fromkeys(out))


def find_source_files(src_dir: str | os.PathLike[str], step: int | str | None = None) -> dict[int, str]:
    """``{rank: file}``: one checkpoint of every rank directory of the source (see the module
    docstring for what is picked). Raises :class:`ConvertError` listing every rank it cannot decide.
    """
    root = os.fspath(src_dir)
    if not os.path.isdir(root):
        raise ConvertError("source directory not found", path=root,
                           hint="--src DIR must hold rank_<N>/ directories (or be a MindFormers output directory)")
    want = parse_step(step)
    chosen: dict[int, _File] = {}
    problems: list[str] = []
    seen: list[_File] = []
    only_breakpoints: list[int] = []
    for rank, path in sorted(runlayout.detect(root).rank_dirs(root).items()):
        files = _rank_files(rank, path)
        seen += files
        if not files:
            continue
        if want is None:
            usable = [f for f in files if not f.is_breakpoint]
            if not usable:
                only_breakpoints.append(rank)
                continue
            if len(usable) > 1:
                problems.append(f"{len(usable)} checkpoints in {path}: {[f.name for f in usable]}")
                continue
            chosen[rank] = usable[0]
            continue
        hits = [f for f in files if f.save is not None and want.matches(f.save)]
        if len(hits) != 1:
            what = "no checkpoint" if not hits else f"several checkpoints {[f.name for f in hits]}"
            problems.append(f"{what} of step {want.text} in {path} (it holds {[f.name for f in files]})")
            continue
        chosen[rank] = hits[0]
    labels = ", ".join(_labels(seen)) or "none named <prefix>-<epoch>_<step>"
    if not problems:
        problems += _mixed_saves(chosen)
    if problems:
        shown = problems[:_MAX_LISTED]
        more = f"; ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise ConvertError("; ".join(shown) + more, path=root,
                           hint=f"pick one save with --step {STEP_SYNTAX} (saves found: {labels})")
    if not chosen:
        hint = "--src DIR must hold rank_<N>/<file>.ckpt (as mindspore.transform_checkpoints expects), or be a " \
               "MindFormers output directory (<out>/checkpoint/rank_<N>/)"
        if only_breakpoints:
            hint = (f"rank(s) {ranks_text(only_breakpoints)} hold only breakpoint saves, which are used only when "
                    f"--step names one (saves found: {labels})")
        raise ConvertError("no rank_<N>/ directory with a checkpoint", path=root, hint=hint)
    return {rank: f.path for rank, f in chosen.items()}


def _mixed_saves(chosen: Mapping[int, _File]) -> list[str]:
    """The files picked (one per rank) must be of one save: a mix is the wrong data."""
    by_save: dict[Save, list[int]] = {}
    for rank, f in sorted(chosen.items()):
        if f.save is not None:
            by_save.setdefault(f.save, []).append(rank)
    if len(by_save) < 2:
        return []
    parts = [f"rank(s) {ranks_text(ranks)}: {chosen[ranks[0]].name}" for _, ranks in
             sorted(by_save.items(), key=lambda kv: kv[1][0])]
    return [f"the rank directories hold checkpoints of different saves ({'; '.join(parts)})"]


# --- strategies ----------------------------------------------------------------------------------


def resolve_strategy(value: Strategy | str | os.PathLike[str] | None) -> Strategy | None:
    """A :class:`Strategy`, None (unsharded), a strategy file, or a *directory* of per-rank
    strategy files (MindFormers' ``<out>/strategy/``; under pipeline parallelism each holds one
    stage), which is merged (:func:`ckptd.format.strategy_merge.merge_rank_strategies`)."""
    if value is None or isinstance(value, Strategy):
        return value
    path = os.fspath(value)
    if not os.path.isdir(path):
        return load_strategy(path)
    try:
        from ckptd.format.strategy_merge import load_rank_strategies, merge_rank_strategies
    except ModuleNotFoundError as err:
        if err.name != "ckptd.format.strategy_merge":
            raise
        raise ConvertError("a directory of per-rank strategy files needs ckptd.format.strategy_merge, which this "
                           "ckptd lacks", path=path,
                           hint="merge them with mindspore.merge_pipeline_strategys and pass the merged file") from None
    return merge_rank_strategies(load_rank_strategies(path), where=path)


# --- indexing ----------------------------------------------------------------------------------


def _probe(cf: CheckpointFile, ent: TensorEntry) -> tuple[bytes | None, bool]:
    """(digest of the payload's first ``PROBE_BYTES``, whether they repeat one element); (None,
    False) for strings, unknown dtypes, empty tensors and encrypted files (not decrypted for this)."""
    if cf.encryption is not None or ent.dtype not in MS_DTYPES:
        return None, False
    isz = itemsize(ent.dtype)
    n = min(ent.nbytes, PROBE_BYTES) // isz * isz
    if n == 0:
        return None, False
    try:
        buf, release = payload_view(cf, ent, 0, n)
        data = bytes(buf)
        del buf
        release()
    except CkptdError:
        return None, False  # the executor refuses the entry with the reason
    return xxhash.xxh3_128_digest(data), repeats_one_element(data, isz)


def _shard_entry(cf: CheckpointFile, e: TensorEntry) -> ShardEntry:
    probe, constant = _probe(cf, e)
    return ShardEntry(e.name, e.dtype, tuple(e.shape), e.nbytes, probe, constant)


#: a source rank's file, or its files (a Checkpoint 2.0 rank: its model file and its optimizer file)
SourceFiles = str | tuple[str, ...]


class RankFiles:
    """One source rank held by several files, read as one checkpoint: each entry is read from the
    file holding it (entry names must not repeat across the files)."""

    def __init__(self, parts: list[CheckpointFile]) -> None:
        self.parts = parts
        self.path = " + ".join(cf.path for cf in parts)
        self.encryption = next((cf.encryption for cf in parts if cf.encryption is not None), None)
        self.problems = tuple(p for cf in parts for p in cf.problems)
        self.entries: dict[str, TensorEntry] = {}
        self._owner: dict[str, CheckpointFile] = {}
        for cf in parts:
            for name, ent in cf.entries.items():
                if name in self._owner:
                    raise ConvertError(f"entry {name!r} is in both {self._owner[name].path} and {cf.path}",
                                       hint="a rank's files must not hold the same tensor twice")
                self.entries[name], self._owner[name] = ent, cf

    def part(self, name: str) -> CheckpointFile:
        try:
            return self._owner[name]
        except KeyError:
            raise CkptdError(f"no entry named {name!r}", path=self.path) from None

    def entry(self, name: str) -> TensorEntry:
        return self.part(name).entry(name)

    def value(self, name: str) -> Any:
        return self.part(name).value(name)

    def read_range(self, name: str, start: int, length: int) -> bytes:
        return self.part(name).read_range(name, start, length)

    def close(self) -> None:
        for cf in self.parts:
            cf.close()

    def __enter__(self) -> "RankFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_source(files: SourceFiles, key: bytes | None) -> CheckpointFile | RankFiles:
    if isinstance(files, str):
        return open_checkpoint(files, key)
    parts: list[CheckpointFile] = []
    try:
        for path in files:
            parts.append(open_checkpoint(path, key))
        return RankFiles(parts)
    except BaseException:
        for cf in parts:
            cf.close()
        raise


def read_inventory(files: Mapping[int, SourceFiles], key: bytes | None = None) -> list[SourceShard]:
    """Index every source file into the planner's input: headers, and a digest of each tensor's
    first bytes (plaintext files), with which the planner checks the source strategy
    (ckptd/convert/consistency.py)."""
    shards = []
    for rank in sorted(files):
        with open_source(files[rank], key) as cf:
            if cf.problems:
                raise cf.problems[0]
            # the files themselves, not a label: the executor reopens them from the plan
            shards.append(SourceShard(rank, files[rank], tuple(_shard_entry(cf, e) for e in cf.entries.values())))
    return shards


def plan_from_dir(
    src_dir: str | os.PathLike[str],
    src_strategy: Strategy | str | os.PathLike[str] | None,
    dst_strategy: Strategy | str | os.PathLike[str] | None,
    *,
    step: int | str | None = None,
    ranks: Sequence[int] | None = None,
    key: bytes | None = None,
) -> ConversionPlan:
    """Find, index and plan; reads headers and one page per tensor, no tensor data. A Checkpoint 2.0
    ``iteration_<it>/`` directory is read with its own layout (``src_strategy`` None: metadata.json's)."""
    from ckptd.convert.iteration_source import is_iteration_dir, iteration_source

    if is_iteration_dir(os.fspath(src_dir)):
        files, own = iteration_source(os.fspath(src_dir))
        src = resolve_strategy(src_strategy) if src_strategy is not None else own
        return plan_conversion(read_inventory(files, key), src, resolve_strategy(dst_strategy), ranks=ranks, subset=True)
    files = find_source_files(src_dir, step)
    return plan_conversion(read_inventory(files, key), resolve_strategy(src_strategy), resolve_strategy(dst_strategy),
                           ranks=ranks)


# --- reading regions -------------------------------------------------------------------------


def _no_release() -> None:
    return None


def payload_view(cf: CheckpointFile, ent: TensorEntry, start: int, length: int) -> tuple[Any, Callable[[], None]]:
    """Payload bytes ``[start, start+length)`` of an entry: a zero-copy view when they lie in one
    segment (+ a function dropping their mapped pages), else a copy (+ a no-op)."""
    if isinstance(cf, RankFiles):
        cf = cf.part(ent.name)
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
    elif arr.ndim > 1 and arr[0].flags.c_contiguous and arr[0].nbytes >= 1024:
        for row in arr:  # a column band: rows hashed in place, 2x faster than copying it first
            h.update(row)
    else:
        h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def region_digest(cf: CheckpointFile, name: str, region: Slice) -> bytes:
    h = xxhash.xxh3_128()
    for _, chunk in region_chunks(cf, name, region):
        hash_update(h, chunk)
    return h.digest()


class OpenSources:
    """Source files opened once and shared by the worker threads."""

    def __init__(self, files: Mapping[int, SourceFiles], key: bytes | None) -> None:
        self.files, self.key = files, key
        self._open: dict[int, CheckpointFile | RankFiles] = {}
        self._lock = threading.Lock()

    def get(self, rank: int) -> CheckpointFile | RankFiles:
        with self._lock:
            cf = self._open.get(rank)
            if cf is None:
                cf = self._open[rank] = open_source(self.files[rank], self.key)
            return cf

    def close(self) -> None:
        with self._lock:
            for cf in self._open.values():
                cf.close()
            self._open.clear()
