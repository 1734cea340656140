"""MindSpore ``.ckpt`` protobuf files: the streaming index (the writer: :mod:`ckptd.format.ckpt_write`).

A ``.ckpt`` file is a concatenation of serialized ``Checkpoint`` messages, each holding one
``Value{tag, tensor{dims, tensor_type, tensor_content}}``, optionally followed by a 17-byte CRC
trailer (``b"crc_num"`` + 10-byte big-endian CRC-32 of everything before it). See
docs/FORMATS.md. The index walks record headers only and records where each payload lies, so a
multi-GB file is indexed without reading its tensor bytes.

Two record parsers give the same result: a fast one for records in the exact form MindSpore
writes (dims, type, content, in that order, headers inside a small window), and the general,
field-by-field one, which also produces every error message. A record the fast parser does not
recognise is parsed again by the general one, so only the general one defines what is accepted.
What an index may hold is bounded (:mod:`ckptd.format.limits`): records, name bytes, problems.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator


from ckptd.errors import CkptdError, CorruptError, FormatError, TruncatedError, UnsupportedDtypeError
from ckptd.format import protowire as pw
from ckptd.format.dtypes import MS_DTYPES, STR_TYPE, itemsize
from ckptd.format.entry import TensorEntry
from ckptd.format.limits import DEFAULT_LIMITS, FormatLimits, LimitExceededError
from ckptd.format.source import ByteSource

CRC_MAGIC = b"crc_num"
CRC_TRAILER_LEN = len(CRC_MAGIC) + 10
#: MindSpore splits a tensor into several records above this many bytes (``SLICE_SIZE`` KiB).
SLICE_BYTES = 512 * 1024 * 1024
MAP_TENSOR_TYPE = "MapTensor"

# Bounds on header fields: a hostile file must not make us build huge Python objects. The number
# of records and the bytes of all names are bounded as well (ckptd.format.limits).
_MAX_TAG_BYTES = 1 << 16
_MAX_TYPE_BYTES = 64
_MAX_DIMS = 64
_HEADER_WINDOW = 64
# The fast parser reads record headers from a window of the file: small after a payload was
# skipped (the next header is all it needs; a large window would fault in tensor pages), larger
# while records are small and follow each other.
_FAST_HEAD = 512
_FAST_CHUNK = 64 << 10

#: dtype names as the index stores them: one shared str per dtype, not one per entry.
_DTYPE_NAMES: dict[bytes, str] = {n.encode(): n for n in (*sorted(MS_DTYPES), STR_TYPE)}


@dataclass(frozen=True, slots=True)
class CrcTrailer:
    stored: int
    offset: int  # where the trailer starts == number of bytes the CRC covers


@dataclass(frozen=True, slots=True)
class CkptIndex:
    entries: dict[str, TensorEntry]
    crc: CrcTrailer | None
    problems: tuple[CkptdError, ...]  # semantic problems found while indexing (structure was fine)
    data_end: int  # end of the protobuf records
    records: int = 0  # protobuf records walked (>= len(entries): tensors over 512 MiB span several)


def find_crc_trailer(source: ByteSource) -> CrcTrailer | None:
    if source.size < CRC_TRAILER_LEN:
        return None
    tail = bytes(source.view(source.size - CRC_TRAILER_LEN, CRC_TRAILER_LEN))
    if tail[: len(CRC_MAGIC)] != CRC_MAGIC:
        return None
    return CrcTrailer(int.from_bytes(tail[len(CRC_MAGIC) :], "big"), source.size - CRC_TRAILER_LEN)


def _small(source: ByteSource, offset: int, limit: int, end: int) -> memoryview:
    """A short window for header parsing, clipped to ``end``."""
    return source.view(offset, min(limit, end - offset))


def _read_len_header(source: ByteSource, pos: int, end: int) -> tuple[int, int, int, int]:
    """Parse one field key (+ length for LEN fields) at ``pos``.

    Returns (field_number, wire_type, value_or_payload_start, next_pos) where, for LEN fields,
    the third element is the payload length and ``next_pos`` the payload start.
    """
    win = _small(source, pos, _HEADER_WINDOW, end)
    key, p = pw.read_varint(win, 0, len(win), pos)
    number, wire = key >> 3, key & 7
    if wire == pw.VARINT:
        value, p = pw.read_varint(win, p, len(win), pos)
        return number, wire, value, pos + p
    if wire == pw.LEN:
        length, p = pw.read_varint(win, p, len(win), pos)
        start = pos + p
        if length > end - start:
            raise TruncatedError(
                f"protobuf field {number} claims {length} bytes but only {end - start} remain", offset=pos
            )
        return number, wire, length, start
    if wire == pw.I64:
        return number, wire, 0, pos + p + 8
    if wire == pw.I32:
        return number, wire, 0, pos + p + 4
    raise CorruptError(f"invalid protobuf wire type {wire} (not a MindSpore checkpoint record)", offset=pos)


@dataclass(slots=True)
class _Record:
    tag: str
    dtype: str
    dims: tuple[int, ...]
    content: tuple[int, int]
    offset: int
    is_map: bool = False
    tag_bytes: int = 0  # UTF-8 length of the tag


def _parse_tensor(source: ByteSource, start: int, end: int, rec: _Record) -> None:
    dims: list[int] = []
    dtype: str | None = None
    content: tuple[int, int] | None = None
    pos = start
    while pos < end:
        num, wire, val, nxt = _read_len_header(source, pos, end)
        if num == 1 and wire == pw.VARINT:
            dims.append(pw.to_signed64(val))
            pos = nxt
        elif num == 1 and wire == pw.LEN:  # packed dims: tolerated although MindSpore never packs
            if val > _MAX_DIMS * 10:
                raise CorruptError(f"tensor {rec.tag!r} has more than {_MAX_DIMS} dims", offset=start)
            blob = source.view(nxt, val)
            dims.extend(pw.to_signed64(v) for v in pw.iter_repeated_varint(blob, pw.Field(1, 2, 0, val, 0)))
            pos = nxt + val
        elif num == 2 and wire == pw.LEN:
            if val > _MAX_TYPE_BYTES:
                raise CorruptError(f"tensor_type of {val} bytes is not a dtype name", offset=pos)
            raw = bytes(source.view(nxt, val))
            dtype = _DTYPE_NAMES.get(raw) or raw.decode("ascii", "replace")
            pos = nxt + val
        elif num == 3 and wire == pw.LEN:
            content = (nxt, val)
            pos = nxt + val
        else:
            pos = nxt + (val if wire == pw.LEN else 0)  # unknown field: skip, as protobuf does
        if len(dims) > _MAX_DIMS:
            raise CorruptError(f"tensor {rec.tag!r} has more than {_MAX_DIMS} dims", offset=start)
    if dtype is None or content is None:
        missing = "tensor_type" if dtype is None else "tensor_content"
        raise CorruptError(f"tensor {rec.tag!r} has no {missing}", offset=rec.offset)
    if any(d < 0 for d in dims):
        raise CorruptError(f"tensor {rec.tag!r} has a negative dimension {dims}", offset=rec.offset)
    rec.dims, rec.dtype, rec.content = tuple(dims), dtype, content


def _parse_value(source: ByteSource, start: int, end: int, offset: int) -> _Record:
    rec = _Record(tag="", dtype="", dims=(), content=(start, 0), offset=offset)
    have_tag = have_value = False
    pos = start
    while pos < end:
        num, wire, val, nxt = _read_len_header(source, pos, end)
        if wire != pw.LEN:
            pos = nxt
            continue
        if num == 1:
            if val > _MAX_TAG_BYTES:
                raise CorruptError(f"parameter name of {val} bytes", offset=pos)
            try:
                rec.tag = bytes(source.view(nxt, val)).decode("utf-8")
            except UnicodeDecodeError:
                raise CorruptError("parameter name is not valid UTF-8", offset=nxt) from None
            rec.tag_bytes = val
            have_tag = True
        elif num == 2:
            _parse_tensor(source, nxt, nxt + val, rec)
            have_value = True
        elif num == 3:  # MapParameter: keys/values/status tensors; indexed opaquely
            rec.is_map, rec.dtype, rec.content = True, MAP_TENSOR_TYPE, (nxt, val)
            have_value = True
        pos = nxt + val
    if not have_tag:
        raise CorruptError("checkpoint record without a parameter name", offset=offset)
    if not have_value:
        raise CorruptError(f"record {rec.tag!r} holds no tensor", offset=offset)
    return rec


def _fast_record(buf: bytes, i: int, base: int, end: int) -> tuple[_Record, int] | None:
    """The record at ``buf[i]`` (file offset ``base + i``) if it has MindSpore's exact form.

    ``0A len {0A n tag 12 m {(08 dim)* 12 k type 1A c content}}`` with every header byte inside
    ``buf``, the content last in the tensor and the tensor last in the value. Returns the record
    and the offset of the next one, or None for anything else (the general parser decides).
    """
    lim = len(buf)
    pos0 = i
    # each varint: at most 10 bytes and inside buf; a longer or cut one -> general parser
    if i >= lim or buf[i] != 0x0A:
        return None
    i += 1
    length = shift = 0
    while True:
        if i >= lim or shift >= 70:
            return None
        b = buf[i]
        i += 1
        length |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
    value_end = base + i + length
    if value_end > end or i >= lim or buf[i] != 0x0A:
        return None
    i += 1
    n = shift = 0
    while True:
        if i >= lim or shift >= 70:
            return None
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
    if n > _MAX_TAG_BYTES or i + n >= lim:
        return None
    try:
        tag = buf[i : i + n].decode("utf-8")
    except UnicodeDecodeError:
        return None
    i += n
    if buf[i] != 0x12:
        return None
    i += 1
    m = shift = 0
    while True:
        if i >= lim or shift >= 70:
            return None
        b = buf[i]
        i += 1
        m |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
    if base + i + m != value_end or i >= lim:
        return None
    dims: list[int] = []
    while buf[i] == 0x08:
        i += 1
        d = shift = 0
        while True:
            if i >= lim or shift >= 70:
                return None
            b = buf[i]
            i += 1
            d |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
        if d >= 1 << 63 or len(dims) == _MAX_DIMS or i >= lim:  # negative, too many: general parser
            return None
        dims.append(d)
    if buf[i] != 0x12:
        return None
    i += 1
    if i >= lim:
        return None
    k = buf[i]
    i += 1
    if k > _MAX_TYPE_BYTES or i + k >= lim:
        return None
    raw_type = buf[i : i + k]
    dtype = _DTYPE_NAMES.get(raw_type) or raw_type.decode("ascii", "replace")
    i += k
    if buf[i] != 0x1A:
        return None
    i += 1
    c = shift = 0
    while True:
        if i >= lim or shift >= 70:
            return None
        b = buf[i]
        i += 1
        c |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
    if base + i + c != value_end:
        return None
    return _Record(tag, dtype, tuple(dims), (base + i, c), base + pos0, False, n), value_end


def iter_records(source: ByteSource, end: int) -> Iterator[_Record]:
    """Every ``Value`` in file order; raises on structural damage with the byte offset."""
    pos = 0
    buf, base = b"", 0  # the fast parser's window: file bytes [base, base + len(buf))
    while pos < end:
        win_end = base + len(buf)
        if pos < base or (pos + _FAST_HEAD > win_end and win_end < end):
            size = _FAST_CHUNK if base <= pos < win_end else _FAST_HEAD  # small records follow: read ahead
            buf, base = bytes(source.view(pos, min(size, end - pos))), pos
        fast = _fast_record(buf, pos - base, base, end)
        if fast is not None:
            rec, pos = fast
            yield rec
            continue
        num, wire, length, payload = _read_len_header(source, pos, end)
        if num != 1 or wire != pw.LEN:
            raise CorruptError(
                f"expected a checkpoint record (field 1) but found field {num}/wire type {wire}", offset=pos
            )
        yield _parse_value(source, payload, payload + length, pos)
        pos = payload + length


class _Problems:
    """Semantic problems of one file, at most ``limit`` of them kept (the rest are counted)."""

    def __init__(self, limit: int) -> None:
        self.items: list[CkptdError] = []
        self.limit = limit
        self.dropped = 0

    def append(self, err: CkptdError) -> None:
        if len(self.items) < self.limit:
            self.items.append(err)
        else:
            self.dropped += 1

    def result(self) -> tuple[CkptdError, ...]:
        if not self.dropped:
            return tuple(self.items)
        more = FormatError(
            f"{self.dropped} more problems not listed (ckptd keeps the first {self.limit})",
            hint="fix the problems listed first; the file is not usable as it is",
        )
        more.unlisted = self.dropped  # type: ignore[attr-defined]  # verify.FileReport adds it up
        return (*self.items, more)


def _finish_entry(first: _Record, segments: list[tuple[int, int]], problems: _Problems,
                  shape: tuple[int, ...]) -> TensorEntry:
    """The entry of a run of records with one tag (``segments``: their payloads, in order)."""
    seg = (first.content,) if len(segments) == 1 else tuple(segments)
    total = first.content[1] if len(segments) == 1 else sum(length for _, length in segments)
    dtype = first.dtype
    if first.is_map or dtype == STR_TYPE:
        return TensorEntry(first.tag, dtype, shape, seg, first.offset)
    if dtype not in MS_DTYPES:
        problems.append(UnsupportedDtypeError(f"tensor {first.tag!r} has unknown dtype {dtype!r}", offset=first.offset))
        return TensorEntry(first.tag, dtype, shape, seg, first.offset)
    # MindSpore's loader turns dims [0] into a scalar (how some writers encode 0-d values).
    if shape == (0,) and total == itemsize(dtype):
        shape = ()
    expected = math.prod(shape) * itemsize(dtype)
    if expected != total:
        problems.append(
            CorruptError(
                f"tensor {first.tag!r} {dtype}{list(shape)} needs {expected} bytes but holds {total}",
                offset=first.offset,
            )
        )
    return TensorEntry(first.tag, dtype, shape, seg, first.offset)


def index_ckpt(source: ByteSource, *, limits: FormatLimits = DEFAULT_LIMITS) -> CkptIndex:
    """Index a plaintext ``.ckpt`` source. Structural damage raises; semantic issues are collected.

    Raises :class:`LimitExceededError` as soon as the file holds more than ``limits.max_entries``
    records, its names more than ``limits.max_name_bytes`` bytes or its distinct shapes more than
    ``limits.max_shape_dims`` dims, so memory stays bounded by the limits whatever the file holds;
    at most ``limits.max_problems`` problems are kept. Records of a split tensor are folded into
    their entry as they come (only their payload locations are kept).
    """
    if source.size == 0:
        raise TruncatedError("empty file (0 bytes): the save never wrote anything", offset=0)
    crc = find_crc_trailer(source)
    end = crc.offset if crc else source.size
    problems = _Problems(limits.max_problems)
    entries: dict[str, TensorEntry] = {}
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per distinct shape, shared
    first: _Record | None = None  # the current run of records with one tag
    shape: tuple[int, ...] = ()
    segments: list[tuple[int, int]] = []
    records = name_bytes = shape_dims = 0
    for rec in iter_records(source, end):
        records += 1
        if records > limits.max_entries:
            raise LimitExceededError(
                f"more than {limits.max_entries} records (the limit of entries per checkpoint file); "
                f"record {records} starts here",
                offset=rec.offset,
            )
        if first is not None and rec.tag == first.tag:  # the next chunk of a split tensor
            if rec.dims != first.dims or rec.dtype != first.dtype:
                problems.append(
                    CorruptError(
                        f"chunks of split tensor {first.tag!r} disagree on shape/dtype "
                        f"({first.dims}/{first.dtype} vs {rec.dims}/{rec.dtype})",
                        offset=rec.offset,
                    )
                )
            segments.append(rec.content)
            continue
        if first is not None:
            _add(entries, _finish_entry(first, segments, problems, shape), problems)
        name_bytes += rec.tag_bytes
        if name_bytes > limits.max_name_bytes:
            raise LimitExceededError(
                f"entry names take more than {limits.max_name_bytes} bytes (the limit per checkpoint file); "
                f"entry {len(entries) + 1} starts here",
                offset=rec.offset,
            )
        shape = shapes.get(rec.dims)  # type: ignore[assignment]
        if shape is None:
            shape_dims += len(rec.dims)
            if shape_dims > limits.max_shape_dims:
                raise LimitExceededError(
                    f"the distinct shapes of the entries have more than {limits.max_shape_dims} dims "
                    "(the limit per checkpoint file)",
                    offset=rec.offset,
                )
            shape = shapes[rec.dims] = rec.dims
        first, segments = rec, [rec.content]
    if first is not None:
        _add(entries, _finish_entry(first, segments, problems, shape), problems)
    if not entries:
        problems.append(CorruptError("checkpoint holds no entries", offset=0))
    return CkptIndex(entries, crc, problems.result(), end, records)


def _add(entries: dict[str, TensorEntry], entry: TensorEntry, problems: _Problems) -> None:
    if entry.name in entries:
        # MindSpore would silently keep the last one; a well-formed save never writes this.
        problems.append(CorruptError(f"entry {entry.name!r} appears twice (not consecutively)", offset=entry.record_offset))
    entries[entry.name] = entry


# --- values ------------------------------------------------------------------------------------


def decode_string(payload: bytes) -> str:
    """``append_dict`` strings are ``np.array(s).tobytes()``: UTF-32-LE, trailing NULs dropped."""
    if len(payload) % 4:
        raise CorruptError(f"string payload of {len(payload)} bytes is not UTF-32 (multiple of 4)")
    try:
        return payload.decode("utf-32-le").rstrip("\x00")
    except UnicodeDecodeError as exc:
        raise CorruptError(f"string payload is not valid UTF-32: {exc.reason}") from None
