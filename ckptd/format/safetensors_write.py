"""Writing MindSpore's ``save_checkpoint(..., format="safetensors")`` files byte for byte.

The format and MindSpore's specifics (metadata keys and their order, the CRC and its 0-d integer
quirk) are described in :mod:`ckptd.format.safetensors_format`, which reads them; this module
builds the same bytes from arrays: the compact serde_json header, the tensors in safetensors'
file order, written atomically.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ckptd.errors import CkptdError, UnsupportedDtypeError
from ckptd.format import dtypes as dt
from ckptd.format import safetensors_format as st_fmt
from ckptd.atomic import atomic_write
from ckptd.format.crc import crc32

__all__ = ["crc_of_items", "encode_header", "write_safetensors"]


@dataclass(frozen=True)
class _Item:
    name: str
    ms_dtype: str
    array: np.ndarray  # C-contiguous, storage dtype

    @property
    def st_dtype(self) -> str:
        return dt.safetensors_name(self.ms_dtype)


def _as_item(name: Any, value: Any, forced: str | None) -> _Item:
    if not isinstance(name, str):
        raise CkptdError(f"tensor name {name!r} is not a string")
    if name == st_fmt.METADATA_KEY:
        raise CkptdError(f"{st_fmt.METADATA_KEY!r} is reserved by safetensors and cannot name a tensor")
    if not st_fmt.is_unicode(name):
        raise CkptdError(f"tensor name {name!r} is not valid Unicode (lone surrogate)")
    typed = getattr(value, "dtype", None)
    if isinstance(typed, str) and hasattr(value, "data"):  # ckptd TypedArray(dtype, data)
        forced, value = forced or typed, value.data
    if isinstance(value, bool):
        arr = np.array(value, dtype="?")
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise CkptdError(f"{name!r}: integer {value} does not fit Int64")
        arr = np.array(value, dtype="<i8")  # MindSpore: Tensor(int) is Int64
    elif isinstance(value, float):
        arr = np.array(value, dtype="<f4")  # MindSpore: Tensor(float) is Float32
    elif isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "__array__"):
        arr = np.asarray(value)
    else:
        raise CkptdError(f"cannot write {name!r} of type {type(value).__name__}", hint="pass numpy arrays")
    if forced is None:
        ms_dtype = dt.ms_name_for(arr.dtype)
    else:
        storage = dt.numpy_dtype(forced)
        ms_dtype = forced
        hint = "BFloat16 takes uint16 bits, Int4 int8 storage; other dtypes must match the array (cast it first)"
        if arr.dtype.byteorder == ">" or arr.dtype.itemsize != storage.itemsize or arr.dtype.kind not in "biuf":
            raise UnsupportedDtypeError(
                f"{name!r}: declared {forced} needs {storage.itemsize}-byte little-endian storage, got {arr.dtype}", hint=hint
            )
        if forced not in ("BFloat16", "Int4") and dt.ms_name_for(arr.dtype) != forced:
            raise UnsupportedDtypeError(f"{name!r}: declared {forced} but the array is {arr.dtype}", hint=hint)
        arr = arr.view(storage) if arr.dtype != storage else arr
    # not np.ascontiguousarray: it turns 0-d arrays into shape (1,)
    return _Item(name, ms_dtype, arr if arr.flags.c_contiguous else arr.copy(order="C"))


def _collect(tensors: Iterable[tuple[str, Any]] | Mapping[str, Any], forced: Mapping[str, str]) -> list[_Item]:
    pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
    items: list[_Item] = []
    seen: set[str] = set()
    for pair in pairs:
        try:
            name, value = pair
        except (TypeError, ValueError):
            raise CkptdError(f"expected (name, array) pairs, got {type(pair).__name__}") from None
        if name in seen:
            raise CkptdError(f"tensor name {name!r} given twice")
        seen.add(name)
        items.append(_as_item(name, value, forced.get(name)))
    unknown = set(forced) - seen
    if unknown:
        raise CkptdError(f"dtypes given for unknown tensors: {sorted(unknown)}")
    return items


def _raw_bytes(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


def crc_of_items(items: Iterable[tuple[str, str, np.ndarray]]) -> int:
    """MindSpore's CRC over (name, MindSpore dtype, contiguous storage array), in the given order."""
    crc = 0
    for name, ms_dtype, arr in items:
        crc = crc32(name.encode("utf-8"), crc)
        if arr.shape == () and ms_dtype in st_fmt.INDEX_QUIRK_DTYPES:
            crc = st_fmt.crc32_zeros(crc, st_fmt.scalar_index(ms_dtype, arr.tobytes(), name))
        else:
            crc = crc32(_raw_bytes(arr), crc)
    return crc


def _ms_metadata(items: list[_Item], metadata: Mapping[str, str] | None, crc: int | None) -> dict[str, str]:
    """The ``__metadata__`` MindSpore's ``_exec_save`` builds, in its insertion order."""
    meta = {"format": "ms"}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CkptdError(f"metadata must map str to str, got {key!r}: {value!r}")
        meta[key] = value
    for item in sorted(items, key=lambda i: i.name):
        if item.ms_dtype == st_fmt.INT4_MARKER:
            meta[item.name] = st_fmt.INT4_MARKER
    if crc is not None:
        meta["crc_num"] = str(crc)
    for key, value in meta.items():
        if not (st_fmt.is_unicode(key) and st_fmt.is_unicode(value)):
            raise CkptdError(f"metadata entry {key!r} is not valid Unicode")
    return meta


def _json_str(text: str) -> str:
    # serde_json escapes exactly what json.dumps(ensure_ascii=False) does: " \\ and C0 controls
    # (\b \f \n \r \t short, others \u00xx lowercase); non-ASCII, DEL and '/' stay raw.
    return json.dumps(text, ensure_ascii=False)


def encode_header(metadata: Mapping[str, str] | None, layout: list[tuple[str, str, tuple[int, ...], int, int]]) -> bytes:
    """serde_json's compact header for (name, safetensors dtype, shape, begin, end) in file order.

    No spaces, ``__metadata__`` first (omitted when None), keys dtype/shape/data_offsets, then
    padded with spaces to a multiple of 8 so that the data starts 8-aligned.
    """
    parts = []
    if metadata is not None:
        body = ",".join(f"{_json_str(k)}:{_json_str(v)}" for k, v in metadata.items())
        parts.append(f'"{st_fmt.METADATA_KEY}":{{{body}}}')
    for name, st_dtype, shape, begin, end in layout:
        dims = ",".join(str(d) for d in shape)
        parts.append(f'{_json_str(name)}:{{"dtype":"{st_dtype}","shape":[{dims}],"data_offsets":[{begin},{end}]}}')
    raw = ("{" + ",".join(parts) + "}").encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def _file_order(items: Iterable[_Item]) -> list[_Item]:
    """safetensors' data order: descending dtype alignment rank, then name (UTF-8 byte order)."""
    return sorted(items, key=lambda i: (-st_fmt.ST_DTYPE_RANK[i.st_dtype], i.name))


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Iterable[tuple[str, Any]] | Mapping[str, Any],
    *,
    metadata: Mapping[str, str] | None = None,
    crc: bool = False,
    dtypes: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> None:
    """Atomically write the file MindSpore's ``save_checkpoint(format="safetensors")`` writes.

    ``tensors`` are (name, value) pairs (or a mapping): numpy arrays, ckptd ``TypedArray``, or
    Python bool/int/float (like ``append_dict``: Bool/Int64/Float32). ``dtypes[name]`` declares
    the MindSpore dtype when numpy cannot (``"BFloat16"`` for uint16 bits, ``"Int4"`` for int8
    storage). ``metadata`` adds keys after ``"format": "ms"`` (e.g. ``{"remove_redundancy":
    "True"}``); Int4 markers and ``crc_num`` (with ``crc``) are added as MindSpore does. With no
    tensors the header is ``{}`` (MindSpore passes no metadata then).

    Arrays are referenced, not copied (except non-contiguous ones), and streamed to disk after
    the header; the output matches MindSpore's bytes except for ``__metadata__`` key order, which
    safetensors randomises (see module doc).
    """
    items = _collect(tensors, dtypes or {})
    crc_value = crc_of_items((i.name, i.ms_dtype, i.array) for i in sorted(items, key=lambda i: i.name)) if crc else None
    meta = _ms_metadata(items, metadata, crc_value) if items else None
    ordered = _file_order(items)
    layout = []
    pos = 0
    for item in ordered:
        layout.append((item.name, item.st_dtype, tuple(item.array.shape), pos, pos + item.array.nbytes))
        pos += item.array.nbytes
    header = encode_header(meta, layout)
    with atomic_write(path, overwrite=overwrite) as fh:
        _stream(fh, header, ordered)


def _stream(fh: BinaryIO, header: bytes, ordered: list[_Item]) -> None:
    fh.write(struct.pack("<Q", len(header)))
    fh.write(header)
    for item in ordered:
        if item.array.nbytes:
            fh.write(_raw_bytes(item.array))
