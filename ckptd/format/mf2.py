"""MindFormers Checkpoint 2.0's JSON records: ``metadata.json``, ``common.json`` and the tracker.

Formats as MindFormers 2.1.0 writes them (``mindformers/checkpoint/metadata.py`` ``save_metadata``,
``checkpoint.py`` ``CommonInfo`` and the tracker write; docs/FORMATS.md, "Checkpoint 2.0"):

* ``metadata.json`` = ``{"state_dict_metadata": {name: {"properties": {"dtype", ...}, "global_shape",
  "axis_fragmentations", "layout", "chunk": [{"global_offset": [i], "local_shape": [...]}, ...]}},
  "storage_data": {"('<name>', (<i>,))": [{"file_name", "storage_rank", "rank_group"}, ...]}}``.
  ``global_offset`` is the *linear slice index* over ``axis_fragmentations`` (not an element offset);
  each storage record says which file holds that slice (several records: dp replicas each wrote it).
* ``common.json`` = the 7 keys of ``CommonInfo`` (any may be null); ``ckpt_status`` 1 = abnormal.
* ``latest_checkpointed_iteration.txt`` = the decimal iteration, no newline, written in place (no
  temp file, no fsync): it can be empty or torn.

Everything here is pure: bytes in, frozen values or a :class:`~ckptd.errors.CorruptError` naming
what is wrong and where.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from typing import Any

from ckptd.errors import CorruptError

#: what ckptd reads of such a file (a 70B model's metadata.json over 256 ranks is tens of MB)
MAX_METADATA_BYTES = 512 << 20
MAX_COMMON_BYTES = 1 << 20
MAX_TRACKER_BYTES = 64
COMMON_KEYS = ("epoch_num", "step_num", "global_step", "loss_scale", "global_batch_size", "consumed_samples",
               "ckpt_status")
ABNORMAL = 1  # CkptStatus.ABNORMAL


@dataclass(frozen=True, slots=True)
class Placement:
    """One slice of a tensor as ``metadata.json`` places it in one file."""

    tensor: str
    slice_index: tuple[int, ...]
    dtype: str  # MindSpore's name, as ckptd's index reports it ("Float32", "BFloat16", ...)
    local_shape: tuple[int, ...] | None  # None: metadata.json has no chunk for that slice
    file_name: str
    storage_rank: int


@dataclass(frozen=True, slots=True)
class IterationMetadata:
    placements: tuple[Placement, ...]

    def by_file(self) -> dict[str, list[Placement]]:
        """File name -> the slices placed in it (one pass: a 70B model's metadata holds ~10^5)."""
        out: dict[str, list[Placement]] = {}
        for p in self.placements:
            out.setdefault(p.file_name, []).append(p)
        return out


@dataclass(frozen=True, slots=True)
class CommonInfo:
    epoch_num: int | None
    step_num: int | None
    global_step: int | None
    loss_scale: float | None
    global_batch_size: int | None
    consumed_samples: int | None
    ckpt_status: int | None

    @property
    def abnormal(self) -> bool:
        return self.ckpt_status == ABNORMAL

    def names_iteration(self, iteration: int) -> bool:
        """Graph-mode saves write ``step_num`` = the iteration; PyNative ones write the configured
        total there and the iteration in ``global_step`` — either one agreeing is agreement."""
        return iteration in (self.step_num, self.global_step)


def _load(raw: bytes, path: str, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        raise CorruptError(f"{what} is not UTF-8 text", path=path, offset=err.start,
                           hint="the file is damaged or not written by MindFormers; re-save the iteration") from None
    except ValueError as err:
        offset = getattr(err, "pos", None)
        raise CorruptError(f"{what} is not valid JSON ({getattr(err, 'msg', err)})", path=path, offset=offset,
                           hint="a torn write (MindFormers replaces it atomically, so rather damage): use an "
                                "older iteration or re-save this one") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return tuple(value)
    return None


def _slice_key(key: str) -> tuple[str, tuple[int, ...]] | None:
    """``"('fc1.weight', (0,))"`` -> ``("fc1.weight", (0,))`` (Python's repr of the tuple)."""
    if len(key) > 4096:  # a parameter name and a slice index; literal_eval of a planted giant costs
        return None
    try:
        value = ast.literal_eval(key)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], tuple)
            and all(isinstance(v, int) and v >= 0 for v in value[1])):
        return value[0], value[1]
    return None


def parse_metadata(raw: bytes, path: str) -> IterationMetadata:
    """The placements ``metadata.json`` promises; a record that cannot be true is an error."""
    return metadata_from_doc(load_metadata_doc(raw, path), path)


def load_metadata_doc(raw: bytes, path: str) -> Any:
    """``metadata.json`` as JSON (for readers that need more of it than the placements: layouts)."""
    return _load(raw, path, "metadata.json")


def metadata_from_doc(doc: Any, path: str) -> IterationMetadata:
    """:func:`parse_metadata` of an already loaded document."""
    if not isinstance(doc, dict) or not isinstance(doc.get("state_dict_metadata"), dict) \
            or not isinstance(doc.get("storage_data"), dict):
        raise CorruptError("metadata.json has no state_dict_metadata / storage_data objects", path=path,
                           hint="not MindFormers' metadata.json; re-save the iteration")
    tensors: dict[str, Any] = doc["state_dict_metadata"]
    placements: list[Placement] = []
    for key, records in doc["storage_data"].items():
        where = f"metadata.json storage_data[{key!r}]"
        parsed = _slice_key(key)
        if parsed is None:
            raise CorruptError(f"{where}: the key is not ('<name>', (<slice>,))", path=path)
        name, index = parsed
        meta = tensors.get(name)
        if not isinstance(meta, dict):
            raise CorruptError(f"{where} places tensor {name!r}, which state_dict_metadata does not describe", path=path,
                               hint="the record lies about the iteration; use an older one")
        dtype = (meta.get("properties") or {}).get("dtype") if isinstance(meta.get("properties"), dict) else None
        if not isinstance(dtype, str):
            raise CorruptError(f"metadata.json: tensor {name!r} has no dtype", path=path)
        local = _local_shape(meta, index, name, path)
        if not isinstance(records, list) or not records:
            raise CorruptError(f"{where}: no file holds this slice", path=path)
        for rec in records:
            file_name = rec.get("file_name") if isinstance(rec, dict) else None
            rank = rec.get("storage_rank") if isinstance(rec, dict) else None
            if not isinstance(file_name, str) or "/" in file_name or file_name in ("", ".", "..") \
                    or not isinstance(rank, int):
                raise CorruptError(f"{where}: a record without a plain file_name and storage_rank: {rec!r}"[:300],
                                   path=path, hint="metadata.json may only name files of its own iteration")
            placements.append(Placement(name, index, dtype, local, file_name, rank))
    return IterationMetadata(tuple(placements))


def _local_shape(meta: dict[str, Any], index: tuple[int, ...], name: str, path: str) -> tuple[int, ...] | None:
    """The local shape of slice ``index``: its chunk's, else derived from the global shape and the
    fragmentation (a slice without its chunk is still placed; the file must then match that)."""
    for chunk in meta.get("chunk") or []:
        if isinstance(chunk, dict) and _ints(chunk.get("global_offset")) == index:
            shape = _ints(chunk.get("local_shape"))
            if shape is None:
                raise CorruptError(f"metadata.json: tensor {name!r} slice {index}: local_shape is not a list of sizes",
                                   path=path)
            return shape
    shape, frags = _ints(meta.get("global_shape")), _ints(meta.get("axis_fragmentations"))
    if shape is not None and frags is not None and len(shape) == len(frags) and all(frags) \
            and all(s % f == 0 for s, f in zip(shape, frags)):
        if len(index) == 1 and index[0] >= max(1, math.prod(frags)):
            raise CorruptError(f"metadata.json: tensor {name!r} has no slice {index[0]} (it is cut into "
                               f"{math.prod(frags)})", path=path)
        return tuple(s // f for s, f in zip(shape, frags))
    return None


def parse_common(raw: bytes, path: str) -> CommonInfo:
    doc = _load(raw, path, "common.json")
    if not isinstance(doc, dict):
        raise CorruptError("common.json is not a JSON object", path=path)
    values: dict[str, Any] = {}
    for key in COMMON_KEYS:
        value = doc.get(key)
        number = (int, float) if key == "loss_scale" else (int,)
        if value is not None and (isinstance(value, bool) or not isinstance(value, number)):
            raise CorruptError(f"common.json: {key} is {value!r}, not a number or null", path=path)
        values[key] = value
    return CommonInfo(**values)


def parse_tracker(raw: bytes) -> int | str:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or why it names none (MindFormers
    itself reads ``int(f.read().strip())``)."""
    text = raw.decode("utf-8", "replace").strip()
    if not text:
        return "empty (a torn write: MindFormers truncates, then writes, without fsync)"
    if not text.isdigit() or len(text) > 19:
        return f"not an iteration number ({text[:20]!r}; a torn or foreign write)"
    return int(text)


def record_problem(raw: bytes, path: str) -> CorruptError | None:
    """What is wrong with a ``common.json`` / ``metadata.json`` as a file (None: it parses)."""
    name = path.rsplit("/", 1)[-1]
    limit = MAX_METADATA_BYTES if name == "metadata.json" else MAX_COMMON_BYTES
    if len(raw) > limit:
        return CorruptError(f"{name} is larger than the {limit} bytes ckptd reads", path=path)
    try:
        (parse_metadata if name == "metadata.json" else parse_common)(raw, path)
    except CorruptError as err:
        return err
    return None
