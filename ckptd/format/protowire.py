"""Minimal protobuf wire-format codec over memoryviews.

ckptd parses MindSpore's protobuf files with this instead of generated classes because it must
(a) index multi-GB files without materialising them, (b) report the exact byte offset of damage,
and (c) never allocate from a hostile length field. Every length is checked against the bytes
that actually remain before anything is sliced.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

from ckptd.errors import CorruptError, TruncatedError

VARINT, I64, LEN, I32 = 0, 1, 2, 5


class Field(NamedTuple):
    number: int
    wire_type: int
    value: int  # the integer for VARINT/I64/I32; for LEN the payload's absolute start offset
    length: int  # LEN payload length; 0 otherwise
    offset: int  # absolute offset of the field's key


def read_varint(buf: memoryview | bytes, pos: int, end: int, base: int = 0) -> tuple[int, int]:
    """Decode a varint at ``pos``; returns (value, next_pos). ``base`` offsets error positions."""
    result = 0
    shift = 0
    start = pos
    while True:
        if pos >= end:
            raise TruncatedError("varint runs past the end of the data", offset=base + start)
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise CorruptError("varint longer than 10 bytes", offset=base + start)


def iter_fields(buf: memoryview | bytes, start: int = 0, end: int | None = None, base: int = 0) -> Iterator[Field]:
    """Yield the fields of one message occupying ``buf[start:end]``.

    Offsets in the yielded :class:`Field` are absolute: ``base`` + position in ``buf``.
    """
    pos = start
    end = len(buf) if end is None else end
    while pos < end:
        key_at = pos
        key, pos = read_varint(buf, pos, end, base)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise CorruptError("protobuf field number 0", offset=base + key_at)
        if wire_type == VARINT:
            value, pos = read_varint(buf, pos, end, base)
            yield Field(number, wire_type, value, 0, base + key_at)
        elif wire_type == LEN:
            length, pos = read_varint(buf, pos, end, base)
            if length > end - pos:
                raise TruncatedError(
                    f"field {number} claims {length} bytes but only {end - pos} remain", offset=base + key_at
                )
            yield Field(number, wire_type, base + pos, length, base + key_at)
            pos += length
        elif wire_type == I64:
            if pos + 8 > end:
                raise TruncatedError("fixed64 runs past the end of the data", offset=base + key_at)
            yield Field(number, wire_type, int.from_bytes(buf[pos : pos + 8], "little"), 0, base + key_at)
            pos += 8
        elif wire_type == I32:
            if pos + 4 > end:
                raise TruncatedError("fixed32 runs past the end of the data", offset=base + key_at)
            yield Field(number, wire_type, int.from_bytes(buf[pos : pos + 4], "little"), 0, base + key_at)
            pos += 4
        else:
            raise CorruptError(f"unsupported protobuf wire type {wire_type}", offset=base + key_at)


def to_signed64(value: int) -> int:
    """Reinterpret a decoded varint as int64/int32 (negative ints are 10-byte two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


# --- encoding --------------------------------------------------------------------------------


def encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    return encode_varint((number << 3) | wire_type)


def len_field(number: int, payload: bytes) -> bytes:
    return key(number, LEN) + encode_varint(len(payload)) + payload


def len_header(number: int, length: int) -> bytes:
    """Key and length of a LEN field whose payload is written separately (streaming)."""
    return key(number, LEN) + encode_varint(length)


def varint_field(number: int, value: int) -> bytes:
    return key(number, VARINT) + encode_varint(value)


def packed_or_repeated_varints(number: int, values: list[int]) -> bytes:
    """proto2 ``repeated`` scalar fields, unpacked (MindSpore's protos do not declare packed)."""
    return b"".join(varint_field(number, v) for v in values)


def iter_repeated_varint(buf: memoryview | bytes, fld: Field, base: int = 0) -> Iterator[int]:
    """Values of a repeated varint field that a writer may have packed (accepted for robustness)."""
    if fld.wire_type == VARINT:
        yield fld.value
        return
    pos = fld.value - base
    end = pos + fld.length
    while pos < end:
        v, pos = read_varint(buf, pos, end, base)
        yield v
