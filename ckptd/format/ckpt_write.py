"""Writing MindSpore ``.ckpt`` files byte for byte (the format: :mod:`ckptd.format.ckpt`).

Entries are encoded the way MindSpore's numpy/async save path encodes them: append values as
0-d Int64/Float32/Bool or UTF-32 strings, tensors above 512 MiB split into several records along
dim 0, and the optional CRC trailer chained over every record written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable

import numpy as np

from ckptd.errors import CkptdError, UnsupportedDtypeError
from ckptd.format import ckpt as ckpt_fmt  # SLICE_BYTES read at call time: one value for reader, writer, convert
from ckptd.format import protowire as pw
from ckptd.format.crc import crc32
from ckptd.format.dtypes import STR_TYPE, ms_name_for, numpy_dtype

CkptValue = Any  # np.ndarray | int | float | bool | str | TypedArray


@dataclass(frozen=True)
class TypedArray:
    """An array whose MindSpore dtype numpy cannot express (BFloat16, Int4): raw storage + name."""

    dtype: str
    data: np.ndarray


def _c_order(arr: np.ndarray) -> np.ndarray:
    # not np.ascontiguousarray: it turns 0-d arrays into shape (1,), which changes the dims written
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def normalise_value(name: str, value: CkptValue) -> tuple[str, tuple[int, ...], np.ndarray | bytes]:
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


def record_chunks(data: np.ndarray | bytes) -> list[memoryview]:
    """MindSpore's numpy-path split: ``np.array_split`` along axis 0 above 512 MiB."""
    if isinstance(data, bytes):
        return [memoryview(data)]
    if data.nbytes / 1024 > ckpt_fmt.SLICE_BYTES / 1024 and data.ndim > 0:
        parts = np.array_split(data, math.ceil(data.nbytes / 1024 / (ckpt_fmt.SLICE_BYTES / 1024)))
        return [memoryview(np.ascontiguousarray(p)).cast("B") for p in parts]
    return [memoryview(data.reshape(-1)).cast("B") if data.size else memoryview(b"")]


def record_header(name: str, dtype: str, dims: tuple[int, ...], content_len: int) -> bytes:
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
        dtype, dims, data = normalise_value(name, value)
        for chunk in record_chunks(data):
            sink.write(record_header(name, dtype, dims, len(chunk)))
            sink.write(chunk)
    if crc:
        out.write(ckpt_fmt.CRC_MAGIC + sink.crc.to_bytes(10, "big"))
    return sink.crc
