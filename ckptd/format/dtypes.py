"""MindSpore dtype names (as written in ``TensorProto.tensor_type``) and their numpy equivalents.

numpy has no bfloat16; BFloat16 payloads are exposed as ``uint16`` arrays holding the raw bits
(``bf16_to_float32`` widens them). That keeps the reader free of optional dtype packages while
staying byte-exact, which is all that verification and re-sharding need.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ckptd.errors import UnsupportedDtypeError

if TYPE_CHECKING:  # numpy loads when an array is made: reading a file's index needs none (ckptd inspect)
    import numpy as np

# MindSpore name -> (numpy storage dtype string, safetensors name)
_TABLE: dict[str, tuple[str, str]] = {
    "Float16": ("<f2", "F16"),
    "Float32": ("<f4", "F32"),
    "Float64": ("<f8", "F64"),
    "BFloat16": ("<u2", "BF16"),
    "Int8": ("i1", "I8"),
    "Int16": ("<i2", "I16"),
    "Int32": ("<i4", "I32"),
    "Int64": ("<i8", "I64"),
    "UInt8": ("u1", "U8"),
    "UInt16": ("<u2", "U16"),
    "UInt32": ("<u4", "U32"),
    "UInt64": ("<u8", "U64"),
    "Bool": ("?", "BOOL"),
    # qint4x2: two 4-bit values per byte; shape counts bytes (MindSpore stores it as int8 storage).
    "Int4": ("i1", "I8"),
}

#: ``tensor_type`` of string entries written through ``append_dict`` (UTF-32-LE payload).
STR_TYPE = "str"

MS_DTYPES: frozenset[str] = frozenset(_TABLE)

#: numpy dtype string -> MindSpore name, for writing (BFloat16 and Int4 are named explicitly)
_FROM_NUMPY: dict[str, str] = {
    "<f2": "Float16", "<f4": "Float32", "<f8": "Float64", "i1": "Int8", "<i2": "Int16", "<i4": "Int32",
    "<i8": "Int64", "u1": "UInt8", "<u2": "UInt16", "<u4": "UInt32", "<u8": "UInt64", "?": "Bool",
}

_SAFETENSORS_TO_MS = {st: ms for ms, (_, st) in _TABLE.items() if ms != "Int4"}


def _storage(ms_name: str) -> str:
    try:
        return _TABLE[ms_name][0]
    except KeyError:
        raise UnsupportedDtypeError(f"unsupported tensor dtype {ms_name!r}") from None


@functools.cache
def numpy_dtype(ms_name: str) -> np.dtype:
    """Storage dtype of a MindSpore dtype name; raises :class:`UnsupportedDtypeError`."""
    import numpy as np

    return np.dtype(_storage(ms_name))


def itemsize(ms_name: str) -> int:
    code = _storage(ms_name)
    return 1 if code == "?" else int(code[-1])  # "<f4": 4 bytes; a bool is one


#: ``struct`` formats of the dtypes whose scalars Python holds exactly (a step counter, a learning rate)
_STRUCT = {"Float16": "<e", "Float32": "<f", "Float64": "<d", "Int8": "<b", "Int16": "<h", "Int32": "<i",
           "Int64": "<q", "UInt8": "<B", "UInt16": "<H", "UInt32": "<I", "UInt64": "<Q", "Bool": "<?"}


def scalar_value(ms_name: str, raw: bytes) -> int | float | bool:
    """A one-element tensor's value as Python holds it (what numpy's ``.item()`` gives), without
    numpy: ``ckptd inspect`` prints ``epoch_num`` and friends and should start fast."""
    import struct

    try:
        return struct.unpack(_STRUCT[ms_name], raw)[0]
    except (KeyError, struct.error):
        raise UnsupportedDtypeError(f"no scalar value for a {ms_name} of {len(raw)} bytes") from None


@functools.cache
def _from_numpy() -> dict[np.dtype, str]:
    import numpy as np

    return {np.dtype(code): name for code, name in _FROM_NUMPY.items()}


def ms_name_for(dtype: np.dtype) -> str:
    """MindSpore name for a numpy dtype (big-endian input is rejected: files are little-endian)."""
    import numpy as np

    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise UnsupportedDtypeError(f"big-endian dtype {dt} cannot be written; convert with .astype('<...')")
    try:
        return _from_numpy()[dt.newbyteorder("<") if dt.byteorder == "=" else dt]
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
    import numpy as np

    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    out = (rounded >> 16).astype("<u2")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype("<u2")
    return out
