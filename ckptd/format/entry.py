"""What a checkpoint holds: one :class:`TensorEntry` per logical tensor, located by byte segments.

An entry never holds data: it says where the payload lies in the file's plaintext so that callers
read only what they need (a whole tensor, or a byte range of it when re-sharding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptd.format.dtypes import STR_TYPE, itemsize


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One logical tensor (or ``append_dict`` value) of a checkpoint.

    ``segments`` are ``(offset, length)`` payload byte ranges in the plaintext, in order; MindSpore
    splits tensors larger than 512 MiB into several consecutive records, so there may be several.
    ``shape`` is the shape of the data in this file (the local slice for per-rank shards).
    """

    name: str
    dtype: str  # MindSpore dtype name, or "str"
    shape: tuple[int, ...]
    segments: tuple[tuple[int, int], ...]
    record_offset: int  # where the first record of this entry starts (for error messages)

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.segments)

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
            "records": len(self.segments),
            "offset": self.record_offset,
        }
