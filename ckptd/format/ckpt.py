"""MindSpore ``.ckpt`` protobuf files: streaming index and byte-compatible writer.

A ``.ckpt`` file is a concatenation of serialized ``Checkpoint`` messages, each holding one
``Value{tag, tensor{dims, tensor_type, tensor_content}}``, optionally followed by a 17-byte CRC
trailer (``b"crc_num"`` + 10-byte big-endian CRC-32 of everything before it). See
docs/FORMATS.md. The index walks record headers only and records where each payload lies, so a
multi-GB file is indexed without reading its tensor bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator

import numpy as np

from ckptd.errors import CkptdError, CorruptError, TruncatedError, UnsupportedDtypeError
from ckptd.format import protowire as pw
from ckptd.format.crc import crc32
from ckptd.format.dtypes import MS_DTYPES, STR_TYPE, itemsize, ms_name_for, numpy_dtype
from ckptd.format.entry import TensorEntry
from ckptd.format.source import ByteSource

CRC_MAGIC = b"crc_num"
CRC_TRAILER_LEN = len(CRC_MAGIC) + 10
#: MindSpore splits a tensor into several records above this many bytes (``SLICE_SIZE`` KiB).
SLICE_BYTES = 512 * 1024 * 1024
MAP_TENSOR_TYPE = "MapTensor"

# Bounds on header fields: a hostile file must not make us build huge Python objects.
_MAX_TAG_BYTES = 1 << 16
_MAX_TYPE_BYTES = 64
_MAX_DIMS = 64
_HEADER_WINDOW = 64


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
            blob = source.view(nxt, val)
            dims.extend(pw.to_signed64(v) for v in pw.iter_repeated_varint(blob, pw.Field(1, 2, 0, val, 0)))
            pos = nxt + val
        elif num == 2 and wire == pw.LEN:
            if val > _MAX_TYPE_BYTES:
                raise CorruptError(f"tensor_type of {val} bytes is not a dtype name", offset=pos)
            dtype = bytes(source.view(nxt, val)).decode("ascii", "replace")
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


def iter_records(source: ByteSource, end: int) -> Iterator[_Record]:
    """Every ``Value`` in file order; raises on structural damage with the byte offset."""
    pos = 0
    while pos < end:
        num, wire, length, payload = _read_len_header(source, pos, end)
        if num != 1 or wire != pw.LEN:
            raise CorruptError(
                f"expected a checkpoint record (field 1) but found field {num}/wire type {wire}", offset=pos
            )
        yield _parse_value(source, payload, payload + length, pos)
        pos = payload + length


def _finish_entry(group: list[_Record], problems: list[CkptdError]) -> TensorEntry:
    first = group[0]
    dims = first.dims
    for rec in group[1:]:
        if rec.dims != first.dims or rec.dtype != first.dtype:
            problems.append(
                CorruptError(
                    f"chunks of split tensor {first.tag!r} disagree on shape/dtype "
                    f"({first.dims}/{first.dtype} vs {rec.dims}/{rec.dtype})",
                    offset=rec.offset,
                )
            )
    segments = tuple(r.content for r in group)
    total = sum(length for _, length in segments)
    dtype = first.dtype
    if first.is_map or dtype == STR_TYPE:
        return TensorEntry(first.tag, dtype, dims, segments, first.offset)
    if dtype not in MS_DTYPES:
        problems.append(UnsupportedDtypeError(f"tensor {first.tag!r} has unknown dtype {dtype!r}", offset=first.offset))
        return TensorEntry(first.tag, dtype, dims, segments, first.offset)
    # MindSpore's loader turns dims [0] into a scalar (how some writers encode 0-d values).
    if dims == (0,) and total == itemsize(dtype):
        dims = ()
    expected = math.prod(dims) * itemsize(dtype)
    if expected != total:
        problems.append(
            CorruptError(
                f"tensor {first.tag!r} {dtype}{list(dims)} needs {expected} bytes but holds {total}",
                offset=first.offset,
            )
        )
    return TensorEntry(first.tag, dtype, dims, segments, first.offset)


def index_ckpt(source: ByteSource) -> CkptIndex:
    """Index a plaintext ``.ckpt`` source. Structural damage raises; semantic issues are collected."""
    if source.size == 0:
        raise TruncatedError("empty file (0 bytes): the save never wrote anything", offset=0)
    crc = find_crc_trailer(source)
    end = crc.offset if crc else source.size
    problems: list[CkptdError] = []
    entries: dict[str, TensorEntry] = {}
    group: list[_Record] = []
    for rec in iter_records(source, end):
        if group and rec.tag != group[0].tag:
            _add(entries, _finish_entry(group, problems), problems)
            group = []
        group.append(rec)
    if group:
        _add(entries, _finish_entry(group, problems), problems)
    if not entries:
        problems.append(CorruptError("checkpoint holds no entries", offset=0))
    return CkptIndex(entries, crc, tuple(problems), end)


def _add(entries: dict[str, TensorEntry], entry: TensorEntry, problems: list[CkptdError]) -> None:
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


# --- writer ------------------------------------------------------------------------------------

CkptValue = Any  # np.ndarray | int | float | bool | str | TypedArray


@dataclass(frozen=True)
class TypedArray:
    """An array whose MindSpore dtype numpy cannot express (BFloat16, Int4): raw storage + name."""

    dtype: str
    data: np.ndarray


def _c_order(arr: np.ndarray) -> np.ndarray:
    # not np.ascontiguousarray: it turns 0-d arrays into shape (1,), which changes the dims written
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _normalise(name: str, value: CkptValue) -> tuple[str, tuple[int, ...], np.ndarray | bytes]:
    """(dtype name, dims, payload) exactly as MindSpore's save path would encode ``value``."""
    if isinstance(value, TypedArray):
        storage = numpy_dtype(value.dtype)
        data = _c_order(value.data)
        if data.dtype.itemsize != storage.itemsize:
            raise UnsupportedDtypeError(f"{name!r}: {value.dtype} needs {storage.itemsize}-byte storage, got {data.dtype}")
        return value.dtype, tuple(data.shape), data
    if isinstance(value, str):
        return STR_TYPE, (0,), np.array(value).tobytes()
    if isinstance(value, bool):
        return "Bool", (), np.array(value, dtype="?")
    if isinstance(value, int):
        return "Int64", (), np.array(value, dtype="<i8")
    if isinstance(value, float):
        return "Float32", (), np.array(value, dtype="<f4")
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        data = _c_order(value)
        return ms_name_for(data.dtype), tuple(data.shape), data
    raise CkptdError(
        f"cannot write entry {name!r} of type {type(value).__name__}",
        hint="pass numpy arrays, TypedArray, or int/float/bool/str append values",
    )


def _chunks(data: np.ndarray | bytes) -> list[memoryview]:
    """MindSpore's numpy-path split: ``np.array_split`` along axis 0 above 512 MiB."""
    if isinstance(data, bytes):
        return [memoryview(data)]
    if data.nbytes / 1024 > SLICE_BYTES / 1024 and data.ndim > 0:
        parts = np.array_split(data, math.ceil(data.nbytes / 1024 / (SLICE_BYTES / 1024)))
        return [memoryview(np.ascontiguousarray(p)).cast("B") for p in parts]
    return [memoryview(data.reshape(-1)).cast("B") if data.size else memoryview(b"")]


def _record_header(name: str, dtype: str, dims: tuple[int, ...], content_len: int) -> bytes:
    tensor_head = pw.packed_or_repeated_varints(1, list(dims)) + pw.len_field(2, dtype.encode()) + pw.len_header(
        3, content_len
    )
    tensor_len = len(tensor_head) + content_len
    value_head = pw.len_field(1, name.encode("utf-8")) + pw.len_header(2, tensor_len)
    value_len = len(value_head) + tensor_len
    return pw.len_header(1, value_len) + value_head + tensor_head


class _CrcSink:
    """Forwards writes and chains the CRC over them, like MindSpore's ``_write_parameter_data``."""

    def __init__(self, out: BinaryIO, enabled: bool) -> None:
        self.out, self.enabled, self.crc = out, enabled, 0

    def write(self, b: bytes | memoryview) -> None:
        if self.enabled:
            self.crc = crc32(b, self.crc)
        self.out.write(b)


def write_ckpt_stream(out: BinaryIO, items: Iterable[tuple[str, CkptValue]], *, crc: bool = False) -> int:
    """Serialize entries to ``out``; returns the CRC of the written records (0 without ``crc``).

    Entries are written in the given order with MindSpore's exact encoding, so the same inputs
    give the same bytes as ``mindspore.save_checkpoint`` (numpy/async path).
    """
    sink = _CrcSink(out, crc)
    for name, value in items:
        dtype, dims, data = _normalise(name, value)
        for chunk in _chunks(data):
            sink.write(_record_header(name, dtype, dims, len(chunk)))
            sink.write(chunk)
    if crc:
        out.write(CRC_MAGIC + sink.crc.to_bytes(10, "big"))
    return sink.crc
