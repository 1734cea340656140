"""MindSpore's ``save_checkpoint(..., format="safetensors")`` files, read and written without ``safetensors``.

Layout (standard safetensors, see docs/FORMATS.md section E): 8-byte little-endian header length
``n``; ``n`` bytes of UTF-8 JSON ``{"__metadata__": {...}, name: {"dtype", "shape",
"data_offsets": [begin, end]}, ...}`` padded with spaces to a multiple of 8; then the raw C-order
little-endian tensor bytes, offsets relative to the end of the header, with no holes.

We parse it ourselves over the :class:`ByteSource` (an mmap) because the daemon must index
multi-GB shards without materialising them, must report *where* a file is damaged, and must stay
lean (the ``safetensors`` wheel is only a test-time second opinion).

MindSpore specifics:

* ``__metadata__`` always has ``"format": "ms"`` (when there is at least one tensor), plus
  ``"remove_redundancy": "True"|"False"`` when that kwarg was given, ``"<name>": "Int4"`` for
  qint4x2 tensors (stored as ``I8``) and ``"crc_num": "<decimal>"`` with ``crc_check=True``.
* The CRC is ``zlib.crc32`` chained over the tensors in sorted-name order: the UTF-8 name, then
  ``bytes(ndarray)``. ``bytes()`` of a 0-d *integer* array calls ``__index__``: it yields
  ``int(a)`` zero bytes rather than the array's bytes (MindSpore fails with "negative count" for
  negative values and runs out of memory for huge ones). 0-d bool/float arrays use their bytes.
* ``safetensors`` writes ``__metadata__`` from a Rust ``HashMap``: its key order is random per
  process, so two MindSpore saves of the same tensors differ in that order. We write the keys in
  the order MindSpore inserts them (format, remove_redundancy, Int4 names sorted, crc_num); every
  other byte (tensor order, offsets, separators, padding, data) is identical.

Reading the header. Every writer built on the ``safetensors`` library (MindSpore, and ckptd's
own) emits serde_json's compact form: ``{"__metadata__":{...},"name":{"dtype":"F32","shape":[..],
"data_offsets":[b,e]},...}`` with no spaces. A scanner reads that form entry by entry into the
index without building JSON objects, up to :data:`~ckptd.format.limits.MAX_HEADER_BYTES`. Any
other JSON goes through the general JSON parser, whose objects cost ~20 times the text, so only
up to :data:`~ckptd.format.limits.MAX_JSON_HEADER_BYTES`; it also produces every error message
for headers the scanner stops at (both give the same index and the same errors where both apply).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptd.errors import CkptdError, CorruptError, FormatError, TruncatedError, UnsupportedDtypeError
from ckptd.format import dtypes as dt
from ckptd.format.crc import crc32, crc32_combine, parallel_crc32
from ckptd.format.entry import TensorEntry
from ckptd.format.limits import (
    DEFAULT_LIMITS,
    MAX_HEADER_BYTES,
    MAX_JSON_HEADER_BYTES,
    FormatLimits,
    LimitExceededError,
)
from ckptd.format.source import ByteSource

if TYPE_CHECKING:  # numpy loads when an array is made (start-up of the commands that only read indexes)
    import numpy as np

FORMAT_MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The format's own ceiling (the Rust reference refuses larger headers): a length field beyond it
is not a safetensors header. ckptd's limit, :data:`MAX_HEADER_BYTES`, is lower."""

__all__ = ["FORMAT_MAX_HEADER_BYTES", "INDEX_QUIRK_DTYPES", "MAX_HEADER_BYTES", "MAX_JSON_HEADER_BYTES",
           "ST_DTYPE_RANK", "SafetensorsIndex", "array_view", "compute_crc", "crc32_zeros", "index_safetensors",
           "is_unicode", "scalar_index", "sniff_safetensors"]

METADATA_KEY = "__metadata__"
INT4_MARKER = "Int4"

#: safetensors' ``Dtype`` enum order (increasing alignment); files list tensors by descending rank, then name.
ST_DTYPE_RANK = {
    name: rank
    for rank, name in enumerate(("BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"))
}

#: MindSpore dtypes whose 0-d numpy arrays hit the ``bytes(int)`` quirk in the CRC.
INDEX_QUIRK_DTYPES = frozenset({"Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "Int4"})
_SIGNED = frozenset({"Int8", "Int16", "Int32", "Int64", "Int4"})
_MAX_SSIZE = 2**63 - 1  # bytes(n) needs n to fit a Py_ssize_t
_PARALLEL_CRC_MIN = 64 << 20


@dataclass(frozen=True)
class SafetensorsIndex:
    """What a safetensors file holds.

    ``entries`` are sorted by name — the order MindSpore hashes (CRC) and loads them — not by data
    offset (safetensors stores larger-alignment dtypes first). Each entry has exactly one segment.
    ``metadata`` is ``__metadata__`` ({} when absent); ``data_start`` = 8 + header length;
    ``crc_stored`` = the parsed ``crc_num`` or None.
    """

    entries: list[TensorEntry]
    metadata: dict[str, str]
    data_start: int
    crc_stored: int | None

    def entry(self, name: str) -> TensorEntry:
        """Linear lookup (callers wanting many lookups build ``{e.name: e for e in entries}``)."""
        for ent in self.entries:
            if ent.name == name:
                return ent
        raise CkptdError(f"no tensor named {name!r}", hint="list entries with `ckptd inspect`")


# --- reading -----------------------------------------------------------------------------------


def sniff_safetensors(head: bytes, file_size: int) -> bool:
    """Whether ``head`` (the first >= 9 bytes) starts a safetensors file.

    True when the length field is plausible (2..FORMAT_MAX_HEADER_BYTES) and the JSON starts with ``{``.
    The file size is deliberately *not* required to cover the header: a truncated safetensors
    file should be indexed (and reported as truncated), not called an unknown format. Protobuf
    ``.ckpt`` files (0x0A, a varint, 0x0A, the name length, the name...) and encrypted ones
    (magic ``D8 5E 3A 7F``) read as lengths far beyond the limit, so they cannot match.
    """
    if len(head) < 9 or file_size < 9:
        return False
    (n,) = struct.unpack_from("<Q", head, 0)
    return 2 <= n <= FORMAT_MAX_HEADER_BYTES and head[8:9] == b"{"


def index_safetensors(source: ByteSource, *, limits: FormatLimits = DEFAULT_LIMITS) -> SafetensorsIndex:
    """Parse and validate the header; never reads tensor data.

    Raises :class:`TruncatedError` when the file is shorter than its header says,
    :class:`UnsupportedDtypeError` for dtypes MindSpore does not write,
    :class:`~ckptd.format.limits.LimitExceededError` beyond ``limits`` (header bytes, entries) and
    :class:`CorruptError` for everything else malformed; each carries the absolute byte offset of
    the problem.
    """
    size = source.size
    if size < 8:
        raise TruncatedError(f"file has {size} bytes; a safetensors file starts with an 8-byte header length", offset=size)
    (n,) = struct.unpack("<Q", bytes(source.view(0, 8)))
    if n > FORMAT_MAX_HEADER_BYTES:
        raise CorruptError(f"header length field says {n} bytes (the format's limit is {FORMAT_MAX_HEADER_BYTES})", offset=0)
    if n > limits.max_header_bytes:
        raise LimitExceededError(f"header length field says {n} bytes, more than ckptd's limit of {limits.max_header_bytes}",
                                 offset=0)
    if n < 2:
        raise CorruptError(f"header length field says {n} bytes; the smallest header is '{{}}'", offset=0)
    data_start = 8 + n
    if data_start > size:
        raise TruncatedError(f"header needs bytes 8..{data_start} but the file has {size}", offset=size)
    view = source.view(8, n)  # scanned in place: no copy of a header that may be 64 MiB
    try:
        scanned = _scan_compact(view, data_start, limits.max_entries, limits.max_shape_dims)
    finally:
        release = getattr(source, "release", None)
        if release is not None:  # the header's pages are done with: keep RSS to the index
            release(8, n)
    raw: bytes | memoryview = view
    if isinstance(scanned, tuple):
        entries, metadata = scanned
    else:
        if n > limits.max_json_header_bytes:
            raise LimitExceededError(
                f"the header is not in the compact form safetensors writers emit (from byte {8 + scanned} on), and at "
                f"{n} bytes it is beyond ckptd's limit of {limits.max_json_header_bytes} for other JSON",
                offset=8 + scanned,
                hint="a MindSpore header is compact JSON: this one is damaged or was written by another tool; "
                "if it is genuine, raise max_json_header_bytes (FormatLimits)",
            )
        raw = bytes(view)
        header = _parse_header(raw)
        metadata = _parse_metadata(header.pop(METADATA_KEY, None), raw)
        if len(header) > limits.max_entries:
            raise LimitExceededError(f"header holds {len(header)} tensors, more than the limit of {limits.max_entries} "
                                     "entries per checkpoint file", offset=8)
        shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        entries = [_parse_entry(name, info, metadata, raw, data_start, shapes) for name, info in header.items()]
        del header
        if sum(len(shape) for shape in shapes) > limits.max_shape_dims:
            raise _too_many_dims(limits.max_shape_dims, 0)
    _check_coverage(entries, data_start, size)
    entries.sort(key=lambda e: e.name)
    return SafetensorsIndex(entries, metadata, data_start, _parse_crc(metadata, raw))


# The compact form, token by token. A JSON string without raw control characters (escapes are
# decoded by json.loads, which also refuses bad ones); integers as JSON writes them (no sign,
# no leading zero) of at most 20 digits; at most 64 dims; dtype names of safetensors' alphabet.
_STR = rb'"(?:[^"\\\x00-\x1f]|\\.)*"'
_INT = rb"(?:0|[1-9][0-9]{0,19})"
_ENTRY = re.compile(
    rb"(" + _STR + rb'):\{"dtype":"([A-Za-z0-9_]{1,32})","shape":\[((?:' + _INT + rb"(?:," + _INT + rb"){0,63})?)\],"
    rb'"data_offsets":\[(' + _INT + rb"),(" + _INT + rb")\]\}"
)
_META_START = b'"__metadata__":{'
_META_PAIR = re.compile(rb"(" + _STR + rb"):(" + _STR + rb")")
_JSON_SPACE_TO_END = re.compile(rb"[ \t\n\r]*\Z")
_STR_CACHE_MAX = 64
_SHAPE_CACHE_KEY, _SHAPE_CACHE_MAX = 64, 1 << 16  # shapes shared by their text: short ones, a bounded number


def _json_string(token: bytes) -> str | None:
    """The text of one JSON string token, or None when it is not valid (the JSON parser will say why)."""
    try:
        if b"\\" in token:
            value = json.loads(token)
            return value if isinstance(value, str) else None
        return token[1:-1].decode("utf-8")
    except (UnicodeDecodeError, ValueError):
        return None


def _too_many_dims(limit: int, pos: int) -> LimitExceededError:
    return LimitExceededError(f"the distinct shapes of the tensors have more than {limit} dims (the limit per "
                              "checkpoint file)", offset=8 + pos)


def _scan_compact(raw: bytes | memoryview, data_start: int, max_entries: int,
                  max_shape_dims: int) -> tuple[list[TensorEntry], dict[str, str]] | int:
    """Index a header in serde_json's compact form, or the offset in ``raw`` where it is not.

    Raises what the general path would raise for a compact header (duplicate names first, then
    the first bad entry; the limit of entries as soon as it is crossed)."""
    if raw[:1] != b"{":
        return 0
    pos = 1
    metadata: dict[str, str] = {}
    if raw[pos : pos + len(_META_START)] == _META_START:
        meta_at = pos
        pos += len(_META_START)
        if raw[pos : pos + 1] != b"}":
            while True:
                m = _META_PAIR.match(raw, pos)
                if m is None:
                    return pos
                key, value = _json_string(m.group(1)), _json_string(m.group(2))
                if key is None or value is None or key in metadata:
                    return pos
                metadata[key] = value
                pos = m.end()
                if raw[pos : pos + 1] != b",":
                    break
                pos += 1
        if raw[pos : pos + 1] != b"}":
            return pos
        pos += 1
        if not all(is_unicode(k) and is_unicode(v) for k, v in metadata.items()):
            raise CorruptError("__metadata__ must map strings to strings", offset=8 + meta_at)
        if raw[pos : pos + 1] == b",":
            pos += 1
            if raw[pos : pos + 1] == b"}":  # a trailing comma is not JSON
                return pos
        elif raw[pos : pos + 1] != b"}":
            return pos
    entries: list[TensorEntry] = []
    count = shape_dims = 0
    seen: set[str] = set()
    dtypes: dict[bytes, str] = {}
    shapes: dict[bytes, tuple[int, ...]] = {}
    first_error: CkptdError | None = None
    duplicate: str | None = None
    if raw[pos : pos + 1] != b"}":
        while True:
            m = _ENTRY.match(raw, pos)
            if m is None:
                return pos
            token, st_raw, shape_raw, begin, end = m.groups()
            name = _json_string(token)
            if name is None or name == METADATA_KEY:
                return pos
            count += 1
            if count > max_entries:
                raise LimitExceededError(
                    f"header holds more than {max_entries} tensors (the limit of entries per checkpoint file)",
                    offset=8 + pos,
                )
            if name in seen and duplicate is None:
                duplicate = name
            seen.add(name)
            st_dtype = dtypes.get(st_raw)
            if st_dtype is None:
                st_dtype = dtypes.setdefault(st_raw, st_raw.decode("ascii")) if len(dtypes) < _STR_CACHE_MAX else st_raw.decode("ascii")
            shape = shapes.get(shape_raw)
            if shape is None:
                shape = tuple(int(d) for d in shape_raw.split(b",")) if shape_raw else ()
                shape_dims += len(shape)
                if shape_dims > max_shape_dims:
                    raise _too_many_dims(max_shape_dims, pos)
                if len(shape_raw) <= _SHAPE_CACHE_KEY and len(shapes) < _SHAPE_CACHE_MAX:
                    shapes[shape_raw] = shape
            if first_error is None:  # after an error: only scan on (a duplicate name is reported first)
                try:
                    entries.append(_make_entry(name, st_dtype, shape, int(begin), int(end), metadata, raw, data_start))
                except CkptdError as err:
                    first_error = err
                    entries.clear()
            pos = m.end()
            if raw[pos : pos + 1] != b",":
                break
            pos += 1
        if raw[pos : pos + 1] != b"}":
            return pos
    pos += 1
    if _JSON_SPACE_TO_END.match(raw, pos) is None:
        return pos
    if duplicate is not None:
        raise CorruptError(f"header names {duplicate!r} twice", offset=_key_offset(raw, duplicate))
    if first_error is not None:
        raise first_error
    return entries, metadata



def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptError(f"header is not UTF-8 ({exc.reason})", offset=8 + exc.start) from None
    if not text.startswith("{"):
        raise CorruptError("header is not a JSON object (does not start with '{')", offset=8)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _DuplicateKey(key)
            out[key] = value
        return out

    try:
        header = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=_reject_constant)
    except _DuplicateKey as exc:
        raise CorruptError(f"header names {exc.key!r} twice", offset=_key_offset(raw, exc.key)) from None
    except json.JSONDecodeError as exc:
        offset = 8 + len(text[: exc.pos].encode("utf-8"))
        raise CorruptError(f"header is not valid JSON: {exc.msg}", offset=offset) from None
    except (ValueError, RecursionError) as exc:  # huge int literals, absurd nesting, NaN/Infinity
        raise CorruptError(f"header is not valid JSON: {exc}", offset=8) from None
    if not isinstance(header, dict):
        raise CorruptError("header is not a JSON object", offset=8)
    return header


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _key_offset(raw: bytes | memoryview, key: str) -> int:
    """Best-effort absolute offset of ``"key":`` in the header (8 = header start if not found).

    Only called to report an error, so a header scanned in place may be copied here."""
    pos = bytes(raw).find(json.dumps(key, ensure_ascii=False).encode("utf-8", "surrogatepass") + b":")
    return 8 + max(pos, 0)


def _parse_metadata(value: Any, raw: bytes) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) and is_unicode(v) and is_unicode(k) for k, v in value.items()):
        raise CorruptError("__metadata__ must map strings to strings", offset=_key_offset(raw, METADATA_KEY))
    return dict(value)


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_error(name: str, raw: bytes, message: str, cls: type[CkptdError] = CorruptError) -> CkptdError:
    # the key's position is only searched for on error: a find per entry would be quadratic
    return cls(f"tensor {name!r}: {message}", offset=_key_offset(raw, name))


def _parse_entry(name: str, info: Any, metadata: dict[str, str], raw: bytes, data_start: int,
                 shapes: dict[tuple[int, ...], tuple[int, ...]]) -> TensorEntry:
    if not is_unicode(name):
        raise _entry_error(name, raw, "name is not valid Unicode (lone surrogate escape)")
    if not isinstance(info, dict):
        raise _entry_error(name, raw, "header entry is not an object")
    st_dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(st_dtype, str):
        raise _entry_error(name, raw, "no string 'dtype'")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise _entry_error(name, raw, "'shape' must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise _entry_error(name, raw, "'data_offsets' must be [begin, end] non-negative integers")
    dims = tuple(shape)
    return _make_entry(name, st_dtype, shapes.setdefault(dims, dims), offsets[0], offsets[1], metadata, raw, data_start)


def _make_entry(name: str, st_dtype: str, shape: tuple[int, ...], begin: int, end: int, metadata: dict[str, str],
                raw: bytes, data_start: int) -> TensorEntry:
    """The entry of a structurally sound header item, or the error about what it says."""
    if not is_unicode(name):
        raise _entry_error(name, raw, "name is not valid Unicode (lone surrogate escape)")
    try:
        ms_dtype = dt.ms_name_from_safetensors(st_dtype)
    except UnsupportedDtypeError as exc:
        raise _entry_error(name, raw, exc.message, UnsupportedDtypeError) from None
    if metadata.get(name) == INT4_MARKER:
        if st_dtype != "I8":
            raise _entry_error(name, raw, f"marked Int4 in __metadata__ but stored as {st_dtype}, not I8")
        ms_dtype = INT4_MARKER
    if end < begin:
        raise _entry_error(name, raw, f"data_offsets end {end} < begin {begin}")
    expected = math.prod(shape) * dt.itemsize(ms_dtype)
    if end - begin != expected:
        raise _entry_error(name, raw, f"{st_dtype}{list(shape)} needs {expected} bytes but data_offsets span {end - begin}")
    return TensorEntry(name, ms_dtype, shape, ((data_start + begin, end - begin),), data_start + begin)


def is_unicode(text: str) -> bool:
    """JSON may escape lone surrogates (Python accepts them, serde_json does not): reject them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_coverage(entries: list[TensorEntry], data_start: int, size: int) -> None:
    """Tensors must tile the data region exactly (safetensors spec: no overlaps, no holes)."""
    pos = data_start
    for ent in sorted(entries, key=lambda e: e.segments[0]):
        begin, length = ent.segments[0]
        if begin < pos:
            raise CorruptError(f"tensor {ent.name!r} overlaps the previous tensor's data", offset=begin)
        if begin > pos:
            raise CorruptError(f"bytes {pos}..{begin} before tensor {ent.name!r} belong to no tensor", offset=pos)
        pos = begin + length
    if pos > size:
        raise TruncatedError(f"tensor data needs bytes up to {pos} but the file has {size}", offset=size)
    if pos < size:
        raise CorruptError(f"{size - pos} trailing bytes after the last tensor belong to no tensor", offset=pos)


def _parse_crc(metadata: dict[str, str], raw: bytes | memoryview) -> int | None:
    text = metadata.get("crc_num")
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and int(text) < 2**32):
        raise CorruptError(f"__metadata__ crc_num {text!r} is not a decimal CRC-32", offset=_key_offset(raw, "crc_num"))
    return int(text)


def array_view(source: ByteSource, entry: TensorEntry) -> np.ndarray:
    """Read-only numpy view of an entry (raw uint16 bits for BFloat16, int8 storage for Int4)."""
    (offset, length), = entry.segments
    import numpy as np

    arr = np.frombuffer(source.view(offset, length), dtype=dt.numpy_dtype(entry.dtype)).reshape(entry.shape)
    arr.flags.writeable = False
    return arr


# --- CRC ---------------------------------------------------------------------------------------


def crc32_zeros(crc: int, count: int) -> int:
    """``zlib.crc32(bytes(count), crc)`` in O(log count) without allocating ``count`` bytes."""
    if count <= 0:
        return crc
    # Appending zeros is linear on the inverted register: shift(~crc) then invert back.
    return crc32_combine(crc ^ 0xFFFFFFFF, 0, count) ^ 0xFFFFFFFF


def scalar_index(ms_dtype: str, raw: bytes | memoryview, name: str) -> int:
    """The length ``bytes()`` gives a 0-d integer array, or an error where MindSpore's own fails."""
    value = int.from_bytes(raw, "little", signed=ms_dtype in _SIGNED)
    if value < 0:
        raise FormatError(
            f"MindSpore's CRC is undefined for the negative 0-d integer {name!r} = {value}",
            hint="MindSpore's bytes(ndarray) fails with 'negative count' here; save this value without crc_check",
        )
    if value > _MAX_SSIZE:
        raise FormatError(
            f"MindSpore's CRC is undefined for the 0-d integer {name!r} = {value} (> 2**63-1)",
            hint="MindSpore's bytes(ndarray) overflows here; save this value without crc_check",
        )
    return value


def _crc_step(crc: int, data: memoryview, workers: int | None) -> int:
    if len(data) >= _PARALLEL_CRC_MIN and workers != 1:
        return crc32_combine(crc, parallel_crc32(data, workers), len(data))
    return crc32(data, crc)


def compute_crc(source: ByteSource, index: SafetensorsIndex, *, workers: int | None = None) -> int:
    """MindSpore's ``crc_num`` for this file's content, streamed over the source (no copies).

    The 0-d integer quirk is reproduced in O(log n) without allocating. BFloat16 tensors are
    hashed by their raw bytes; MindSpore itself cannot hash them (numpy refuses a buffer for its
    bfloat16 dtype), so it never writes such a CRC nor verifies one (``crc_check`` load fails).
    """
    crc = 0
    release = getattr(source, "release", None)
    for ent in sorted(index.entries, key=lambda e: e.name):
        crc = crc32(ent.name.encode("utf-8"), crc)
        (offset, length), = ent.segments
        view = source.view(offset, length)
        if ent.shape == () and ent.dtype in INDEX_QUIRK_DTYPES:
            try:
                crc = crc32_zeros(crc, scalar_index(ent.dtype, view, ent.name))
            except CkptdError as exc:
                exc.offset = offset
                exc.args = (str(exc),)
                raise
        else:
            crc = _crc_step(crc, view, workers)
        if release is not None:  # unmap what is done (and let a digest riding on the reads take it)
            release(offset, length)
    return crc
