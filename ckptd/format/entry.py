"""What a checkpoint holds: one :class:`TensorEntry` per logical tensor, located by byte segments.

An entry never holds data: it says where the payload lies in the file's plaintext so that callers
read only what they need (a whole tensor, or a byte range of it when re-sharding).

Entries are many (one per tensor, up to :data:`ckptd.format.limits.MAX_ENTRIES` per file) and
live as long as a file is open or its index is cached, so an entry is kept small: a slotted
object whose usual single segment is two plain fields rather than a tuple of tuples, whose
record offset is stored as the (small, shared) distance to the payload, and whose dtype and
shape objects the indexers share between entries. About 200 bytes plus the name.
"""

from __future__ import annotations

import math
from typing import Any

from ckptd.format.dtypes import STR_TYPE, itemsize

Segments = tuple[tuple[int, int], ...]


class TensorEntry:
    """One logical tensor (or ``append_dict`` value) of a checkpoint. Immutable.

    ``segments`` are ``(offset, length)`` payload byte ranges in the plaintext, in order; MindSpore
    splits tensors larger than 512 MiB into several consecutive records, so there may be several.
    ``shape`` is the shape of the data in this file (the local slice for per-rank shards).
    ``record_offset`` is where the first record of this entry starts (for error messages).
    """

    __slots__ = ("_gap", "_length", "_more", "_start", "dtype", "name", "shape")

    name: str
    dtype: str  # MindSpore dtype name, or "str"
    shape: tuple[int, ...]

    def __init__(
        self, name: str, dtype: str, shape: tuple[int, ...], segments: Segments, record_offset: int
    ) -> None:
        first, *rest = segments
        start, length = first
        put = object.__setattr__
        put(self, "name", name)
        put(self, "dtype", dtype)
        put(self, "shape", shape)
        put(self, "_start", start)
        put(self, "_length", length)
        put(self, "_gap", start - record_offset)  # a record header's length: a small cached int
        put(self, "_more", tuple(rest) if rest else None)

    # --- immutability, equality, pickling ------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"TensorEntry is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"TensorEntry is immutable (cannot delete {name!r})")

    def _key(self) -> tuple[Any, ...]:
        return (self.name, self.dtype, self.shape, self.segments, self.record_offset)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"TensorEntry(name={self.name!r}, dtype={self.dtype!r}, shape={self.shape!r}, "
            f"segments={self.segments!r}, record_offset={self.record_offset!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (TensorEntry, self._key())

    # --- location ------------------------------------------------------------------------------

    @property
    def segments(self) -> Segments:
        first = ((self._start, self._length),)
        return first if self._more is None else first + self._more

    @property
    def record_offset(self) -> int:
        return self._start - self._gap

    @property
    def nbytes(self) -> int:
        if self._more is None:
            return self._length
        return self._length + sum(length for _, length in self._more)

    # --- what it holds -------------------------------------------------------------------------

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_string(self) -> bool:
        return self.dtype == STR_TYPE

    @property
    def is_scalar(self) -> bool:
        return self.shape == () and not self.is_string

    def expected_nbytes(self) -> int | None:
        """Payload size implied by dtype and shape (None for strings, whose length is free)."""
        if self.is_string:
            return None
        return self.numel * itemsize(self.dtype)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "bytes": self.nbytes,
            "records": 1 if self._more is None else 1 + len(self._more),
            "offset": self.record_offset,
        }
