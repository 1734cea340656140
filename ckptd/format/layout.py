"""Pure slice math for MindSpore tensor layouts (device matrix + tensor map + optimizer shard).

ckptd must know, without running MindSpore, exactly which elements of a full parameter every rank
stores, so that it can verify, deduplicate and re-shard per-rank checkpoint shards. The rules
below reproduce what MindSpore's training (C++ ``TensorLayout`` + parallel optimizer) stores in a
rank's shard; the tests check them element-for-element against ``mindspore.parallel._tensor``:

* local rank -> coordinate: row-major over ``dev_matrix`` (last axis fastest), like
  ``_rank_to_coordinate``.
* ``tensor_map[i] = m`` splits tensor dim ``i`` over ``dev_matrix[len-1-m]`` (axes are counted from
  the right); ``-1`` leaves it whole. A nested entry ``(m1, m2, ...)`` ("layout" API, one axis split
  over several device axes) splits the dim over all of them, ``m1`` outermost (``_expand_layout``).
* optimizer shard (``opt_shard_size`` != 0): dim 0 of the model-parallel slice is cut again into
  ``n`` equal parts (``n = opt_shard_size``, ``-1`` = the whole replica group). The ranks holding the
  same model-parallel slice, in ascending order, are cut into consecutive allgather groups of ``n``
  (``OperatorInfo::CreateGroupForOptShard``); a rank keeps part ``position % n``. ``opt_shard_step``
  is only ``(last-first)/(size-1)`` of that replica group as MindSpore recorded it; it is kept for
  round-tripping but not needed for the math (``(rank // step) % n`` is the same thing whenever the
  replica group is an arithmetic progression).

Everything here is a pure function of frozen dataclasses; errors are :class:`LayoutError`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Union

import numpy as np

from ckptd.errors import LayoutError

#: one tensor_map entry: a device-axis number (or -1), or a nested tuple of axis numbers.
TensorMapEntry = Union[int, tuple[int, ...]]

#: refuse device matrices beyond this many ranks per stage: no cluster is that big, and per-rank
#: loops (replica_groups) must stay bounded for hostile files.
MAX_DEVICES = 1 << 20


def _is_int(value: object) -> bool:
    """Python or numpy integers (shapes often come from numpy), never bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _int_tuple(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(_is_int(v) for v in value):
        raise LayoutError(f"{what} must be a sequence of integers, got {value!r}")
    return tuple(int(v) for v in value)


def _normalise_map(tensor_map: object, ndev: int) -> tuple[TensorMapEntry, ...]:
    if not isinstance(tensor_map, (tuple, list)):
        raise LayoutError(f"tensor_map must be a sequence, got {tensor_map!r}")
    out: list[TensorMapEntry] = []
    used: set[int] = set()
    for i, entry in enumerate(tensor_map):
        if _is_int(entry):
            axes: tuple[int, ...] = (int(entry),)
            out.append(int(entry))
        elif isinstance(entry, (tuple, list)) and entry and all(_is_int(v) for v in entry):
            axes = tuple(int(v) for v in entry)
            out.append(axes)
            if len(axes) > 1 and -1 in axes:
                raise LayoutError(f"tensor_map[{i}] = {list(axes)} mixes -1 with device axes")
        else:
            raise LayoutError(f"tensor_map[{i}] = {entry!r} is neither an axis number nor a non-empty list of them")
        for m in axes:
            if m == -1:
                continue
            if not 0 <= m < ndev:
                raise LayoutError(
                    f"tensor_map[{i}] refers to device axis {m} but dev_matrix has {ndev} axes",
                    hint="tensor_map entries count device-matrix axes from the right and must be -1 or < len(dev_matrix)",
                )
            if m in used:
                raise LayoutError(f"device axis {m} is used by more than one tensor dimension")
            used.add(m)
    return tuple(out)


@dataclass(frozen=True)
class TensorLayout:
    """One parameter's layout as stored in a strategy file (``ParallelLayouts``).

    Sequences given as lists are normalised to tuples; invalid combinations raise
    :class:`LayoutError` at construction so that every later computation can trust the fields.
    """

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[TensorMapEntry, ...]
    opt_shard_step: int = 0
    opt_shard_size: int = 0
    field: int = 0
    param_split_shape: tuple[int, ...] = ()
    indices_offset: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        dev = _int_tuple(self.dev_matrix, "dev_matrix")
        if any(d <= 0 for d in dev):
            raise LayoutError(f"dev_matrix {list(dev)} has a non-positive dimension")
        if math.prod(dev) > MAX_DEVICES:
            raise LayoutError(f"dev_matrix {list(dev)} spans more than {MAX_DEVICES} devices")
        object.__setattr__(self, "dev_matrix", dev)
        object.__setattr__(self, "tensor_map", _normalise_map(self.tensor_map, len(dev)))
        object.__setattr__(self, "param_split_shape", _int_tuple(self.param_split_shape, "param_split_shape"))
        object.__setattr__(self, "indices_offset", _int_tuple(self.indices_offset, "indices_offset"))
        for name in ("opt_shard_step", "opt_shard_size", "field"):
            if not _is_int(getattr(self, name)):
                raise LayoutError(f"{name} must be an integer, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))
        step, size = self.opt_shard_step, self.opt_shard_size
        if step < 0 or size < -1:
            raise LayoutError(f"invalid optimizer shard step={step} size={size}")
        if (step == 0) != (size == 0):
            raise LayoutError(
                f"optimizer shard step={step} and size={size} must both be zero or both be set",
                hint="MindSpore records opt_weight_shard_step and opt_weight_shard_size together",
            )
        if size != 0:
            if not self.tensor_map:
                raise LayoutError("optimizer sharding of a scalar (empty tensor_map)")
            if size > 0 and self.replica_count % size:
                raise LayoutError(
                    f"opt_weight_shard_size {size} does not divide the {self.replica_count} ranks holding "
                    f"each model-parallel slice (dev_matrix {list(dev)}, tensor_map {self.tensor_map_lists()})"
                )

    # --- derived quantities ----------------------------------------------------------------

    @property
    def device_num(self) -> int:
        """Ranks of one pipeline stage covered by this layout (``prod(dev_matrix)``)."""
        return math.prod(self.dev_matrix)

    @property
    def ndim(self) -> int:
        return len(self.tensor_map)

    @property
    def nested(self) -> bool:
        return any(isinstance(e, tuple) for e in self.tensor_map)

    def tensor_map_lists(self) -> list[int | list[int]]:
        """tensor_map as MindSpore's Python tools print it (nested entries as lists)."""
        return [list(e) if isinstance(e, tuple) else e for e in self.tensor_map]

    def dim_axes(self) -> tuple[tuple[int, ...], ...]:
        """For each tensor dim, the dev_matrix *indices* splitting it, outermost first."""
        n = len(self.dev_matrix)
        out = []
        for entry in self.tensor_map:
            axes = entry if isinstance(entry, tuple) else (entry,)
            out.append(tuple(n - 1 - m for m in axes if m != -1))
        return tuple(out)

    @property
    def mp_split_counts(self) -> tuple[int, ...]:
        """Model-parallel split count per tensor dim (``_get_tensor_strategy``)."""
        return tuple(math.prod(self.dev_matrix[i] for i in axes) for axes in self.dim_axes())

    @property
    def replica_count(self) -> int:
        """Ranks holding each model-parallel slice (before optimizer sharding)."""
        return self.device_num // math.prod(self.mp_split_counts)

    @property
    def opt_shard_active(self) -> bool:
        return self.opt_shard_count > 1

    @property
    def opt_shard_count(self) -> int:
        """Resolved optimizer shard count (``-1`` -> the whole replica group; 1 when off)."""
        if self.opt_shard_size == 0:
            return 1
        if self.opt_shard_size == -1:
            return self.replica_count
        return self.opt_shard_size

    @property
    def split_counts(self) -> tuple[int, ...]:
        """Total split count per tensor dim, including the optimizer shard on dim 0."""
        counts = list(self.mp_split_counts)
        if counts:
            counts[0] *= self.opt_shard_count
        return tuple(counts)

    def canonical(self) -> dict[str, object]:
        """Semantic content: equal for layouts that place every element on the same ranks.

        Nested one-axis entries collapse to plain ints; the optimizer shard is resolved and the
        informational step dropped unless sharding is active (then it is kept as recorded).
        """
        tmap: list[object] = []
        for entry in self.tensor_map:
            if isinstance(entry, tuple) and len(entry) == 1:
                entry = entry[0]
            tmap.append(list(entry) if isinstance(entry, tuple) else entry)
        active = self.opt_shard_active
        return {
            "dev_matrix": list(self.dev_matrix),
            "tensor_map": tmap,
            "opt_shard_size": self.opt_shard_count if active else 0,
            "opt_shard_step": self.opt_shard_step if active else 0,
            "field": self.field,
            "param_split_shape": list(self.param_split_shape),
            "indices_offset": list(self.indices_offset),
        }


@dataclass(frozen=True)
class Slice:
    """A hyper-rectangle of a full tensor: ``offsets[i] : offsets[i] + sizes[i]`` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets = _int_tuple(self.offsets, "offsets")
        sizes = _int_tuple(self.sizes, "sizes")
        if len(offsets) != len(sizes) or any(v < 0 for v in offsets + sizes):
            raise LayoutError(f"invalid slice offsets={list(offsets)} sizes={list(sizes)}")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def index(self) -> tuple[slice, ...]:
        """A numpy index selecting this slice from the full array: ``full[s.index]``."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def overlap(self, other: "Slice") -> "Slice | None":
        """The common part of two slices of the same tensor, or None when they are disjoint."""
        if len(other.offsets) != len(self.offsets):
            raise LayoutError(f"cannot intersect slices of rank {len(self.offsets)} and {len(other.offsets)}")
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        stops = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(e <= s for s, e in zip(starts, stops)):
            return None
        return Slice(starts, tuple(e - s for s, e in zip(starts, stops)))

    def relative_to(self, container: "Slice") -> "Slice":
        """This slice in the coordinates of ``container`` (which must contain it)."""
        if self.overlap(container) != self and self.numel:
            raise LayoutError(f"{self} is not inside {container}")
        return Slice(tuple(a - b for a, b in zip(self.offsets, container.offsets)), self.sizes)


def _check_shape(layout: TensorLayout, shape: tuple[int, ...] | list[int], what: str) -> tuple[int, ...]:
    shape = _int_tuple(shape, what)
    if len(shape) != layout.ndim:
        raise LayoutError(
            f"{what} {list(shape)} has {len(shape)} dims but tensor_map {layout.tensor_map_lists()} has {layout.ndim}"
        )
    if any(d < 0 for d in shape):
        raise LayoutError(f"{what} {list(shape)} has a negative dimension")
    if layout.param_split_shape:
        raise LayoutError(
            f"uneven split param_split_shape={list(layout.param_split_shape)} is not supported",
            hint="MindSpore's checkpoint transform tools do not support manual (uneven) splits either",
        )
    return shape


def local_shape(layout: TensorLayout, full_shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Shape of the shard every rank stores for a parameter of ``full_shape``."""
    full = _check_shape(layout, full_shape, "full shape")
    out = []
    for i, (dim, count) in enumerate(zip(full, layout.split_counts)):
        if dim % count:
            raise LayoutError(
                f"dim {i} of full shape {list(full)} is not divisible by its split count {count} "
                f"(dev_matrix {list(layout.dev_matrix)}, tensor_map {layout.tensor_map_lists()}, "
                f"optimizer shard {layout.opt_shard_count})"
            )
        out.append(dim // count)
    return tuple(out)


def full_shape_from_local(layout: TensorLayout, local: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """The full shape MindSpore infers from one rank's shard (``_transform_parallel_checkpoint``)."""
    shard = _check_shape(layout, local, "local shape")
    return tuple(d * c for d, c in zip(shard, layout.split_counts))


def _coordinate(layout: TensorLayout, local_rank: int) -> list[int]:
    if not _is_int(local_rank) or not 0 <= local_rank < layout.device_num:
        raise LayoutError(f"local rank {local_rank!r} outside 0..{layout.device_num - 1} of dev_matrix {list(layout.dev_matrix)}")
    coord = [0] * len(layout.dev_matrix)
    rest = local_rank
    for i in range(len(layout.dev_matrix) - 1, -1, -1):
        rest, coord[i] = divmod(rest, layout.dev_matrix[i])
    return coord


def _opt_part(layout: TensorLayout, coord: list[int]) -> int:
    """Position of the rank among the ranks holding its model-parallel slice, mod the shard count."""
    used = {i for axes in layout.dim_axes() for i in axes}
    pos = 0
    for i, (c, d) in enumerate(zip(coord, layout.dev_matrix)):
        if i not in used:
            pos = pos * d + c
    return pos % layout.opt_shard_count


def slice_for_rank(layout: TensorLayout, full_shape: tuple[int, ...] | list[int], local_rank: int) -> Slice:
    """The part of the full tensor stored by ``local_rank`` (rank within its pipeline stage)."""
    shard = local_shape(layout, full_shape)
    coord = _coordinate(layout, local_rank)
    offsets = []
    for dim, axes in enumerate(layout.dim_axes()):
        index = 0
        for i in axes:
            index = index * layout.dev_matrix[i] + coord[i]
        if dim == 0 and layout.opt_shard_active:
            index = index * layout.opt_shard_count + _opt_part(layout, coord)
        offsets.append(index * shard[dim])
    return Slice(tuple(offsets), shard)


def replica_groups(layout: TensorLayout, full_shape: tuple[int, ...] | list[int]) -> list[tuple[int, ...]]:
    """Local ranks grouped by identical slice, each group ascending, groups by their first rank."""
    groups: dict[Slice, list[int]] = {}
    for rank in range(layout.device_num):
        groups.setdefault(slice_for_rank(layout, full_shape, rank), []).append(rank)
    return [tuple(g) for g in groups.values()]
