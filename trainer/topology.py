"""Rank topology (tp x dp) and the tensor layouts the trainer really uses.

Pure data and math, no MindSpore import: the launcher, the tests and the strategy writer share it.
Global rank = ``dp_index * tp + tp_index``, i.e. the row-major index in ``dev_matrix = (dp, tp)``
(MindSpore's convention: last axis fastest), so ``tensor_map`` entry ``0`` names the tp axis and
``-1`` means "whole along this dim" (replicated over every rank of the other axes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ckptd.format.layout import TensorLayout

#: how one parameter is split: "col" = output rows over tp (column-parallel Linear, vocab-parallel
#: embedding/head, weights stored (out, in)), "row" = input columns over tp (row-parallel Linear),
#: "rep" = replicated on every rank (RMSNorm weights).
Split = Literal["col", "row", "rep"]


@dataclass(frozen=True)
class Topology:
    """Where one rank sits in the (dp, tp) grid."""

    tp: int
    dp: int
    rank: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp and dp must be >= 1, got tp={self.tp} dp={self.dp}")
        if not 0 <= self.rank < self.tp * self.dp:
            raise ValueError(f"rank {self.rank} outside world of {self.tp * self.dp}")

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def tp_index(self) -> int:
        return self.rank % self.tp

    @property
    def dp_index(self) -> int:
        return self.rank // self.tp

    @property
    def tp_ranks(self) -> list[int]:
        return [self.dp_index * self.tp + i for i in range(self.tp)]

    @property
    def dp_ranks(self) -> list[int]:
        return [d * self.tp + self.tp_index for d in range(self.dp)]

    @property
    def dev_matrix(self) -> tuple[int, int]:
        return (self.dp, self.tp)


def layout_for(split: Split, ndim: int, topo: Topology) -> TensorLayout:
    """The strategy-file layout of a parameter split ``split`` (moments share their weight's layout)."""
    if split == "rep":
        tensor_map: tuple[int, ...] = (-1,) * ndim
    elif split == "col":
        tensor_map = (0,) + (-1,) * (ndim - 1)
    elif split == "row":
        if ndim != 2:
            raise ValueError("row-parallel parameters are 2-D (out, in)")
        tensor_map = (-1, 0)
    else:
        raise ValueError(f"unknown split {split!r}")
    return TensorLayout(dev_matrix=topo.dev_matrix, tensor_map=tensor_map)
