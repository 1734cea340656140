"""MindSpore dtype names (as written in ``TensorProto.tensor_type``) and their numpy equivalents.

numpy has no bfloat16; BFloat16 payloads are exposed as ``uint16`` arrays holding the raw bits
(``bf16_to_float32`` widens them). That keeps the reader free of optional dtype packages while
staying byte-exact, which is all that verification and re-sharding need.
"""

from __future__ import annotations

import numpy as np

from ckptd.errors import UnsupportedDtypeError

# MindSpore name -> (numpy storage dtype, safetensors name)
_TABLE: dict[str, tuple[np.dtype, str]] = {
    "Float16": (np.dtype("<f2"), "F16"),
    "Float32": (np.dtype("<f4"), "F32"),
    "Float64": (np.dtype("<f8"), "F64"),
    "BFloat16": (np.dtype("<u2"), "BF16"),
    "Int8": (np.dtype("i1"), "I8"),
    "Int16": (np.dtype("<i2"), "I16"),
    "Int32": (np.dtype("<i4"), "I32"),
    "Int64": (np.dtype("<i8"), "I64"),
    "UInt8": (np.dtype("u1"), "U8"),
    "UInt16": (np.dtype("<u2"), "U16"),
    "UInt32": (np.dtype("<u4"), "U32"),
    "UInt64": (np.dtype("<u8"), "U64"),
    "Bool": (np.dtype("?"), "BOOL"),
    # qint4x2: two 4-bit values per byte; shape counts bytes (MindSpore stores it as int8 storage).
    "Int4": (np.dtype("i1"), "I8"),
}

#: ``tensor_type`` of string entries written through ``append_dict`` (UTF-32-LE payload).
STR_TYPE = "str"

MS_DTYPES: frozenset[str] = frozenset(_TABLE)

_FROM_NUMPY: dict[np.dtype, str] = {
    np.dtype("<f2"): "Float16",
    np.dtype("<f4"): "Float32",
    np.dtype("<f8"): "Float64",
    np.dtype("i1"): "Int8",
    np.dtype("<i2"): "Int16",
    np.dtype("<i4"): "Int32",
    np.dtype("<i8"): "Int64",
    np.dtype("u1"): "UInt8",
    np.dtype("<u2"): "UInt16",
    np.dtype("<u4"): "UInt32",
    np.dtype("<u8"): "UInt64",
    np.dtype("?"): "Bool",
}

_SAFETENSORS_TO_MS = {st: ms for ms, (_, st) in _TABLE.items() if ms != "Int4"}


def numpy_dtype(ms_name: str) -> np.dtype:
    """Storage dtype of a MindSpore dtype name; raises :class:`UnsupportedDtypeError`."""
    try:
        return _TABLE[ms_name][0]
    except KeyError:
        raise UnsupportedDtypeError(f"unsupported tensor dtype {ms_name!r}") from None


def itemsize(ms_name: str) -> int:
    return numpy_dtype(ms_name).itemsize


def ms_name_for(dtype: np.dtype) -> str:
    """MindSpore name for a numpy dtype (big-endian input is rejected: files are little-endian)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise UnsupportedDtypeError(f"big-endian dtype {dt} cannot be written; convert with .astype('<...')")
    try:
        return _FROM_NUMPY[dt.newbyteorder("<") if dt.byteorder == "=" else dt]
    except KeyError:
        raise UnsupportedDtypeError(
            f"numpy dtype {dt} has no MindSpore checkpoint equivalent",
            hint="use float16/32/64, int8..int64, uint8..uint64 or bool (bfloat16 as raw uint16 with dtype='BFloat16')",
        ) from None


def safetensors_name(ms_name: str) -> str:
    numpy_dtype(ms_name)
    return _TABLE[ms_name][1]


def ms_name_from_safetensors(st_name: str) -> str:
    try:
        return _SAFETENSORS_TO_MS[st_name]
    except KeyError:
        raise UnsupportedDtypeError(f"unsupported safetensors dtype {st_name!r}") from None


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bits (uint16) to float32 exactly."""
    return (raw.astype("<u4") << 16).view("<f4")


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits (round-to-nearest-even, NaN preserved) as uint16."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    out = (rounded >> 16).astype("<u2")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype("<u2")
    return out
