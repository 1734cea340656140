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
what is wrong and where (a :class:`~ckptd.format.limits.LimitExceededError` beyond ckptd's limits:
``metadata.json`` is read in one bounded pass, never whole into Python objects; docs/FORMATS.md
section 6).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import CkptdError, CorruptError
from ckptd.format.limits import (
    MAX_JSON_DEPTH,
    MAX_METADATA_BYTES,
    MAX_METADATA_ITEMS,
    MAX_METADATA_TENSORS,
    MAX_METADATA_VALUE_BYTES,
    LimitExceededError,
    json_too_deep,
)

__all__ = ["MAX_COMMON_BYTES", "MAX_METADATA_BYTES", "MAX_TRACKER_BYTES", "CommonInfo", "IterationMetadata",
           "Placement", "parse_common", "parse_metadata", "parse_tracker", "record_problem"]

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
    #: tensor -> its ``layout`` (MindSpore's ``Layout.to_dict()``) as compact JSON text, for tensors
    #: that have one (text costs a fraction of the objects; a converter parses one at a time)
    layouts: dict[str, str] = field(default_factory=dict)

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


_DAMAGED = ("a torn write (MindFormers replaces it atomically, so rather damage): use an older iteration or "
            "re-save this one")
_CRAFTED = ("MindFormers' own records are far below this (docs/FORMATS.md section 6): the file is damaged or was "
            "crafted; use an older iteration or re-save this one")


def _load(raw: bytes, path: str, what: str, base: int = 0) -> Any:
    """A small JSON text (``common.json``, one bounded value of ``metadata.json`` at byte ``base``)."""
    if json_too_deep(raw):
        raise _too_deep(what, path, base)
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        raise CorruptError(f"{what} is not UTF-8 text", path=path, offset=base + err.start,
                           hint="the file is damaged or not written by MindFormers; re-save the iteration") from None
    except RecursionError:  # json_too_deep counts brackets; this is the parser's own guard
        raise _too_deep(what, path, base) from None
    except ValueError as err:
        offset = getattr(err, "pos", None)
        raise CorruptError(f"{what} is not valid JSON ({getattr(err, 'msg', err)})", path=path,
                           offset=None if offset is None else base + offset, hint=_DAMAGED) from None


def _too_deep(what: str, path: str, offset: int | None) -> CorruptError:
    return CorruptError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels", path=path, offset=offset, hint=_CRAFTED)


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return tuple(value)
    return None


_PY_SLICE_KEY = re.compile(r"\('([^'\\]*)', \(([0-9]+(?:, [0-9]+)*),?\)\)")


def _slice_key(key: str) -> tuple[str, tuple[int, ...]] | None:
    """``"('fc1.weight', (0,))"`` -> ``("fc1.weight", (0,))`` (Python's repr of the tuple)."""
    m = _PY_SLICE_KEY.fullmatch(key)  # MindFormers' form: ~20 times faster than literal_eval
    if m is not None:
        return m.group(1), tuple(int(v) for v in m.group(2).split(", "))
    if len(key) > 4096:  # a parameter name and a slice index; literal_eval of a planted giant costs
        return None
    try:
        value = ast.literal_eval(key)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], tuple)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value[1])):
        return value[0], value[1]
    return None


def _plain_name(file_name: object) -> bool:
    return isinstance(file_name, str) and "/" not in file_name and file_name not in ("", ".", "..")


# --- metadata.json, read in one bounded pass ---------------------------------------------------------
#
# Python's JSON parser builds every object of the file at once: ~4 times the text for MindFormers' own
# file, up to ~26 times for a crafted one. The scanner below walks the two objects MindFormers writes
# entry by entry. Storage records (the bulk: every replica's rank group) are matched whole by one
# regular expression and kept as (file name, rank); each tensor's description goes through the JSON
# parser alone (at most MAX_METADATA_VALUE_BYTES). What the result may hold is counted while scanning
# (limits.MAX_METADATA_TENSORS / MAX_METADATA_ITEMS), and nesting is bounded (MAX_JSON_DEPTH). Layouts are
# kept as compact text, at most the file's size in all: re-dumped with \u escapes, layouts of non-ASCII
# strings took 3 times the file (a crafted 500 MiB file: +1.5 GiB).

_S = rb"[ \t\n\r]*+"
_STR_RE = rb'"(?:[^"\\\x00-\x1f]|\\.)*+"'
_INT_RE = rb"-?(?:0|[1-9][0-9]{0,18})"
_WS = re.compile(_S)
_STR = re.compile(_STR_RE)
_SCALAR = re.compile(_STR_RE + rb"|-?(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?(?:[eE][-+]?[0-9]++)?|true|false|null")
_RUN = re.compile(rb'(?:[^"\[\]{}]++|"(?:[^"\\]|\\.)*+")*+')  # up to the next bracket outside strings
_RECORD = re.compile(
    rb"\{" + _S + rb'"file_name"' + _S + rb":" + _S + rb"(" + _STR_RE + rb")" + _S + rb"," + _S + rb'"storage_rank"'
    + _S + rb":" + _S + rb"(" + _INT_RE + rb")" + _S + rb"," + _S + rb'"rank_group"' + _S + rb":" + _S + rb"\[" + _S
    + rb"(?:" + _INT_RE + rb"(?:" + _S + rb"," + _S + _INT_RE + rb")*+)?" + _S + rb"\]" + _S + rb"\}")
_BAD = object()  # a chunk whose local_shape is not a list of sizes


@dataclass(slots=True)
class _Tensor:
    name: str
    dtype: str | None
    shape: tuple[int, ...] | None
    frags: tuple[int, ...] | None
    chunks: dict[tuple[int, ...], object] | None  # slice index -> local shape, or _BAD (None: no chunks)


class _Scan:
    def __init__(self, raw: bytes, path: str) -> None:
        self.raw, self.path, self.n = raw, path, len(raw)
        self.items = 0
        self.tensors: dict[str, _Tensor | None] = {}
        self.tensors_done = False
        self.slices: set[str] = set()
        self.pending: list[tuple[str, tuple[int, ...], list[tuple[str, int]], str, int]] = []
        self.placements: list[Placement] = []
        self.layouts: dict[str, str] = {}
        self.layout_chars = 0  # of the layouts kept: at most the file's size
        self.shared: dict[Any, Any] = {}  # file names, dtypes, shapes and ranks: one object each
        self.not_objects = CorruptError("metadata.json has no state_dict_metadata / storage_data objects", path=path,
                                        hint="not MindFormers' metadata.json; re-save the iteration")

    # --- JSON, token by token ----------------------------------------------------------------------

    def invalid(self, message: str, pos: int) -> CorruptError:
        return CorruptError(f"metadata.json is not valid JSON ({message})", path=self.path, offset=pos, hint=_DAMAGED)

    def limit(self, message: str, pos: int) -> LimitExceededError:
        return LimitExceededError(f"metadata.json {message}", path=self.path, offset=pos, hint=_CRAFTED)

    def ws(self, pos: int) -> int:
        return _WS.match(self.raw, pos).end()  # type: ignore[union-attr]

    def string(self, pos: int) -> tuple[str, int]:
        m = _STR.match(self.raw, pos)
        if m is None:
            raise self.invalid("expected a string", pos)
        token = m.group()
        try:
            return (json.loads(token) if b"\\" in token else token[1:-1].decode("utf-8")), m.end()
        except (ValueError, UnicodeDecodeError):
            raise self.invalid("a string that is not valid JSON text", pos) from None

    def span(self, pos: int) -> int:
        """The end of the JSON value at ``pos`` (structure only: the parser checks the rest)."""
        raw, start = self.raw, pos
        if raw[pos : pos + 1] not in (b"[", b"{"):
            m = _SCALAR.match(raw, pos)
            if m is None:
                raise self.invalid("expected a value", pos)
            return m.end()
        depth = 0
        while True:
            if pos >= self.n:
                raise self.invalid("the text ends inside a value", self.n)
            c = raw[pos]
            if c in b"[{":
                depth += 1
                if depth > MAX_JSON_DEPTH:
                    raise _too_deep("metadata.json", self.path, pos)
            elif c in b"]}":
                depth -= 1
                if depth == 0:
                    return pos + 1
            else:
                raise self.invalid("an unterminated string", pos)
            pos = _RUN.match(raw, pos + 1).end()  # type: ignore[union-attr]
            if pos - start > MAX_METADATA_VALUE_BYTES:
                raise self.limit(f"holds a value of more than {MAX_METADATA_VALUE_BYTES} bytes where MindFormers "
                                 "writes a few KB", start)

    def value(self, pos: int) -> tuple[Any, int]:
        end = self.span(pos)
        if end - pos > MAX_METADATA_VALUE_BYTES:
            raise self.limit(f"holds a value of more than {MAX_METADATA_VALUE_BYTES} bytes", pos)
        return _load(self.raw[pos:end], self.path, "metadata.json", pos), end

    def obj(self, pos: int, member, seen: set[str] | None = None) -> int:
        """Walk the object at ``pos``: ``member(key, value position)`` returns the value's end."""
        raw = self.raw
        pos = self.ws(pos)
        if raw[pos : pos + 1] != b"{":
            self.value(pos)  # valid JSON of another type, or the reason it is not JSON
            raise self.not_objects
        pos = self.ws(pos + 1)
        if raw[pos : pos + 1] == b"}":
            return pos + 1
        while True:
            key_at = pos
            key, pos = self.string(pos)
            if seen is not None:
                if key in seen:
                    raise CorruptError(f"metadata.json has {key!r} twice", path=self.path, offset=key_at, hint=_DAMAGED)
                seen.add(key)
            pos = self.ws(pos)
            if raw[pos : pos + 1] != b":":
                raise self.invalid("expected ':' after a key", pos)
            pos = self.ws(member(key, self.ws(pos + 1)))
            c = raw[pos : pos + 1]
            if c == b"}":
                return pos + 1
            if c != b",":
                raise self.invalid("expected ',' or '}'", pos)
            pos = self.ws(pos + 1)

    def count(self, pos: int) -> None:
        self.items += 1
        if self.items > MAX_METADATA_ITEMS:
            raise self.limit(f"holds more than {MAX_METADATA_ITEMS} slices and storage records (ckptd's limit; a "
                             "256-rank Llama-2-70B save holds ~100,000)", pos)

    def share(self, value: Any) -> Any:
        return self.shared.setdefault(value, value)

    # --- the document ----------------------------------------------------------------------------------

    def run(self) -> IterationMetadata:
        seen: set[str] = set()

        def section(key: str, pos: int) -> int:
            if key == "state_dict_metadata":
                end = self.obj(pos, self.tensor)
                self.tensors_done = True
                for item in self.pending:
                    self.place(*item)
                self.pending.clear()
                return end
            if key == "storage_data":
                return self.obj(pos, self.slice_records)
            return self.value(pos)[1]  # a key MindFormers 2.1.0 does not write: checked, not kept

        end = self.obj(self.ws(0), section, seen)
        if self.ws(end) != self.n:
            raise self.invalid("text after the object", self.ws(end))
        if not {"state_dict_metadata", "storage_data"} <= seen:
            raise self.not_objects
        return IterationMetadata(tuple(self.placements), self.layouts)

    def tensor(self, name: str, pos: int) -> int:
        if name in self.tensors:
            raise CorruptError(f"metadata.json describes tensor {name!r} twice", path=self.path, offset=pos,
                               hint=_DAMAGED)
        if len(self.tensors) >= MAX_METADATA_TENSORS:
            raise self.limit(f"describes more than {MAX_METADATA_TENSORS} tensors (ckptd's limit)", pos)
        meta, end = self.value(pos)
        if not isinstance(meta, dict):
            self.tensors[name] = None
            return end
        props = meta.get("properties")
        dtype = props.get("dtype") if isinstance(props, dict) else None
        chunks: dict[tuple[int, ...], object] = {}
        for chunk in meta.get("chunk") if isinstance(meta.get("chunk"), list) else ():
            index = _ints(chunk.get("global_offset")) if isinstance(chunk, dict) else None
            if index is not None and index not in chunks:  # the first chunk of a slice is its shape
                self.count(pos)
                shape = _ints(chunk.get("local_shape"))
                chunks[self.share(index)] = _BAD if shape is None else self.share(shape)
        shape, frags = _ints(meta.get("global_shape")), _ints(meta.get("axis_fragmentations"))
        self.tensors[name] = _Tensor(name, self.share(dtype) if isinstance(dtype, str) else None, shape, frags,
                                     chunks or None)
        if meta.get("layout"):
            text = json.dumps(meta["layout"], separators=(",", ":"))
            self.layout_chars += len(text)
            if self.layout_chars > self.n:  # MindFormers' layouts are compact ASCII: their copies fit in the file
                raise self.limit("holds layouts that are longer than the file itself once kept as compact JSON text "
                                 "(characters outside ASCII, each kept as a 6-byte \\u escape)", pos)
            self.layouts[name] = text
        return end

    def slice_records(self, key: str, pos: int) -> int:
        where = f"metadata.json storage_data[{key!r}]"
        if key in self.slices:
            raise CorruptError(f"{where} appears twice", path=self.path, offset=pos, hint=_DAMAGED)
        self.slices.add(key)
        parsed = _slice_key(key)
        if parsed is None:
            raise CorruptError(f"{where}: the key is not ('<name>', (<slice>,))", path=self.path, offset=pos)
        records, end = self.records(pos, where)
        if self.tensors_done:
            self.place(parsed[0], parsed[1], records, where, pos)
        else:  # storage_data before state_dict_metadata (not MindFormers' order): placed once that is read
            self.pending.append((parsed[0], parsed[1], records, where, pos))
        return end

    def records(self, pos: int, where: str) -> tuple[list[tuple[str, int]], int]:
        raw, out = self.raw, []
        if raw[pos : pos + 1] != b"[":
            self.value(pos)
            raise CorruptError(f"{where}: no file holds this slice", path=self.path, offset=pos)
        pos = self.ws(pos + 1)
        if raw[pos : pos + 1] == b"]":
            return out, pos + 1
        while True:
            m = _RECORD.match(raw, pos)
            if m is not None:  # MindFormers' record: its rank group is matched, never built
                file_name, _ = self.string(m.start(1))
                rank, end = int(m.group(2)), m.end()
                rec: Any = {"file_name": file_name, "storage_rank": rank}
            else:  # another key order or more keys: the JSON parser, on this record alone
                rec, end = self.value(pos)
                file_name = rec.get("file_name") if isinstance(rec, dict) else None
                rank = rec.get("storage_rank") if isinstance(rec, dict) else None
            if not _plain_name(file_name) or not isinstance(rank, int) or isinstance(rank, bool):
                raise CorruptError(f"{where}: a record without a plain file_name and storage_rank: {rec!r}"[:300],
                                   path=self.path, offset=pos,
                                   hint="metadata.json may only name files of its own iteration")
            self.count(pos)
            out.append((self.share(file_name), self.share(rank)))
            pos = self.ws(end)
            c = raw[pos : pos + 1]
            if c == b"]":
                return out, pos + 1
            if c != b",":
                raise self.invalid("expected ',' or ']'", pos)
            pos = self.ws(pos + 1)

    def place(self, name: str, index: tuple[int, ...], records: list[tuple[str, int]], where: str, pos: int) -> None:
        meta = self.tensors.get(name)
        if meta is None:
            raise CorruptError(f"{where} places tensor {name!r}, which state_dict_metadata does not describe",
                               path=self.path, offset=pos, hint="the record lies about the iteration; use an older one")
        if meta.dtype is None:
            raise CorruptError(f"metadata.json: tensor {name!r} has no dtype", path=self.path, offset=pos)
        local = _local_shape(meta, index, self.path)
        if not records:
            raise CorruptError(f"{where}: no file holds this slice", path=self.path, offset=pos)
        index = self.share(index)
        self.placements.extend(Placement(meta.name, index, meta.dtype, local, f, r) for f, r in records)


def parse_metadata(raw: bytes, path: str) -> IterationMetadata:
    """The placements ``metadata.json`` promises (and the tensors' layouts); a record that cannot be
    true is a :class:`~ckptd.errors.CorruptError`, one beyond ckptd's limits a
    :class:`~ckptd.format.limits.LimitExceededError`. Memory: the text, plus ~100 bytes per placement
    and the layouts (as text: at most the text's size again)."""
    if len(raw) > MAX_METADATA_BYTES:
        raise _too_large("metadata.json", len(raw), MAX_METADATA_BYTES, path)
    return _Scan(raw, path).run()


def _too_large(name: str, size: int, limit: int, path: str) -> LimitExceededError:
    return LimitExceededError(f"{name} is {size} bytes, more than the {limit} bytes ckptd reads", path=path,
                              hint=_CRAFTED)


def _local_shape(meta: _Tensor, index: tuple[int, ...], path: str) -> tuple[int, ...] | None:
    """The local shape of slice ``index``: its chunk's, else derived from the global shape and the
    fragmentation (a slice without its chunk is still placed; the file must then match that)."""
    name = meta.name
    shape = meta.chunks.get(index) if meta.chunks else None
    if shape is _BAD:
        raise CorruptError(f"metadata.json: tensor {name!r} slice {index}: local_shape is not a list of sizes",
                           path=path)
    if shape is not None:
        return shape  # type: ignore[return-value]
    shape, frags = meta.shape, meta.frags
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


def record_problem(raw: bytes, path: str) -> CkptdError | None:
    """What is wrong with a ``common.json`` / ``metadata.json`` as a file (None: it parses)."""
    name = path.rsplit("/", 1)[-1]
    limit = MAX_METADATA_BYTES if name == "metadata.json" else MAX_COMMON_BYTES
    if len(raw) > limit:
        return _too_large(name, len(raw), limit, path)
    try:
        (parse_metadata if name == "metadata.json" else parse_common)(raw, path)
    except CkptdError as err:
        return err
    return None
