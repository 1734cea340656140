"""Slice math against MindSpore's own helpers: every rank must select exactly MindSpore's elements."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.errors import LayoutError
from ckptd.format.layout import (
    Slice,
    TensorLayout,
    full_shape_from_local,
    local_shape,
    replica_groups,
    slice_for_rank,
)

DEV_MATRICES = [(8,), (2, 4), (4, 2), (2, 2, 2), (2, 3, 2), (1, 4, 2), (3, 1, 2), (2, 2, 1, 2)]


def _tensor_maps(ndev: int, ndim: int):
    """Every flat tensor_map of ``ndim`` dims over ``ndev`` axes (each axis used at most once)."""
    for combo in itertools.product(range(-1, ndev), repeat=ndim):
        used = [m for m in combo if m != -1]
        if len(used) == len(set(used)):
            yield combo


def _flat_layouts(limit_per_dev: int = 40):
    out = []
    for dev in DEV_MATRICES:
        maps = [m for nd in (1, 2, 3) for m in _tensor_maps(len(dev), nd)]
        step = max(1, len(maps) // limit_per_dev)
        out += [(dev, m) for m in maps[::step]]
    return out


def _full_shape(layout: TensorLayout, local=(2, 3, 1)) -> tuple[int, ...]:
    return tuple(c * local[i % len(local)] for i, c in enumerate(layout.split_counts))


def _step(layout: TensorLayout, full) -> int:
    """opt_weight_shard_step as MindSpore's C++ records it: (last-first)/(n-1) of the replica group."""
    group = replica_groups(TensorLayout(layout.dev_matrix, layout.tensor_map), full)[0]
    return (group[-1] - group[0]) // (len(group) - 1)


def _opt_layouts():
    """(dev, map, size) with an optimizer shard: every divisor > 1 of the replica count."""
    out = []
    for dev, tmap in _flat_layouts(12):
        base = TensorLayout(dev, tmap)
        for n in range(2, base.replica_count + 1):
            if base.replica_count % n == 0:
                out.append((dev, tmap, n))
    return out


def test_mp_slices_match_load_tensor(ms):
    """No optimizer shard: ``_tensor._load_tensor`` for every rank of many layouts."""
    from mindspore.parallel._tensor import _load_tensor

    cases = _flat_layouts()
    assert len(cases) > 150
    for dev, tmap in cases:
        layout = TensorLayout(dev, tmap)
        full = _full_shape(layout)
        arr = np.arange(math.prod(full), dtype=np.int32).reshape(full)
        tensor = ms.Tensor(arr)
        for rank in range(layout.device_num):
            expected = _load_tensor(tensor, list(dev), list(tmap), rank_id=rank)
            got = arr[slice_for_rank(layout, full, rank).index]
            np.testing.assert_array_equal(got, expected, err_msg=f"dev={dev} map={tmap} rank={rank}")


def _write_layouts(ms, path, layouts: dict[str, TensorLayout]) -> str:
    """A strategy file built with MindSpore's own generated schema (node_strategy_pb2)."""
    msg = ms.train.node_strategy_pb2.ParallelStrategyMap()
    msg.current_stage = 1
    for name, lay in layouts.items():
        item = msg.parallel_layout_item.add()
        item.param_name = name
        pl = item.parallel_layouts
        pl.dev_matrix.add().dim.extend(lay.dev_matrix)
        pl.tensor_map.add().dim.extend(lay.tensor_map)
        pl.param_split_shape.add()
        pl.indices_offset.add()
        pl.field = 0
        pl.opt_weight_shard_step = lay.opt_shard_step
        pl.opt_weight_shard_size = lay.opt_shard_size
    path.write_bytes(msg.SerializeToString())
    return str(path)


def test_opt_shard_matches_parameter_redundancy_and_load_tensor(ms, tmp_path):
    """Optimizer shard: MindSpore's ``get_parameter_redundancy`` says which ranks share each part
    (part k of a model-parallel group = its k-th subgroup), ``_load_tensor`` + ``np.split`` gives
    the part's elements; ours must agree element for element, and on the replica groups."""
    from mindspore.parallel._tensor import _load_tensor
    from mindspore.train._utils import get_parameter_redundancy

    cases = {}
    for i, (dev, tmap, n) in enumerate(_opt_layouts()):
        probe = TensorLayout(dev, tmap)
        full = _full_shape(probe, local=(n * 2, 3, 1))
        cases[f"p{i}"] = (TensorLayout(dev, tmap, _step(probe, full), n), full)
    assert len(cases) > 60
    path = _write_layouts(ms, tmp_path / "opt.ckpt", {k: v[0] for k, v in cases.items()})
    redundancy = get_parameter_redundancy(path, initial_rank=0)
    for name, (layout, full) in cases.items():
        n = layout.opt_shard_count
        groups = redundancy[name]
        assert sorted(groups) == sorted(replica_groups(layout, full)), name
        part = {r: k % n for k, g in enumerate(groups) for r in g}
        arr = np.arange(math.prod(full), dtype=np.int32).reshape(full)
        tensor = ms.Tensor(arr)
        for rank in range(layout.device_num):
            mp = _load_tensor(tensor, list(layout.dev_matrix), list(layout.tensor_map), rank_id=rank)
            expected = np.split(mp, n, axis=0)[part[rank]]
            np.testing.assert_array_equal(arr[slice_for_rank(layout, full, rank).index], expected, err_msg=f"{layout} {rank}")


def _transform_is_self_consistent(layout: TensorLayout) -> bool:
    """MindSpore's transform fast path (only dev axis 0 repeated) renumbers ranks in tensor-dim
    order; it matches training only when split axes appear in tensor dims in dev-matrix order."""
    used = [a for axes in layout.dim_axes() for a in axes]
    repeated = [i for i, d in enumerate(layout.dev_matrix) if i not in used and d > 1]
    return repeated != [0] or used == sorted(used)


def test_opt_shard_matches_checkpoint_transform_layout(ms):
    """The layout ``_construct_tensor_layout_for_opt_shard`` builds for transform_checkpoints,
    sliced with ``_load_tensor``, selects our elements (where MindSpore is self-consistent)."""
    from mindspore.parallel._tensor import _construct_tensor_layout_for_opt_shard, _load_tensor

    checked = 0
    for dev, tmap, n in _opt_layouts():
        probe = TensorLayout(dev, tmap)
        full = _full_shape(probe, local=(n * 2, 3, 1))
        layout = TensorLayout(dev, tmap, _step(probe, full), n)
        if not _transform_is_self_consistent(layout):
            continue
        try:
            new_dev, new_map, new_full = _construct_tensor_layout_for_opt_shard(
                list(dev), list(tmap), layout.opt_shard_step, n, full
            )
        except ValueError:
            # MindSpore's transform cannot split a repeated dev axis unevenly (e.g. 2 of a 3-axis)
            # although training accepts any divisor of the replica count; nothing to compare.
            continue
        arr = np.arange(math.prod(full), dtype=np.int32).reshape(full)
        tensor = ms.Tensor(arr.reshape(new_full))
        for rank in range(layout.device_num):
            expected = _load_tensor(tensor, new_dev, new_map, rank_id=rank).reshape(local_shape(layout, full))
            np.testing.assert_array_equal(arr[slice_for_rank(layout, full, rank).index], expected, err_msg=f"{layout} {rank}")
        checked += 1
    assert checked > 40


def test_transform_fast_path_disagreement_is_mindsporess_not_ours(ms, tmp_path):
    """dev [2,2,3], map [0,1]: training (and get_parameter_redundancy) put rows 4..7 on rank 1,
    checkpoint_transform's fast path would not. We follow training."""
    from mindspore.parallel._tensor import _construct_tensor_layout_for_opt_shard, _load_tensor
    from mindspore.train._utils import get_parameter_redundancy

    layout = TensorLayout((2, 2, 3), (0, 1), 6, 2)
    full = (12, 4)
    arr = np.arange(48, dtype=np.int32).reshape(full)
    mp_rank1 = _load_tensor(ms.Tensor(arr), [2, 2, 3], [0, 1], rank_id=1)
    assert set(arr[slice_for_rank(layout, full, 1).index].ravel()) <= set(mp_rank1.ravel())
    path = _write_layouts(ms, tmp_path / "s.ckpt", {"w": layout})
    assert sorted(get_parameter_redundancy(path, initial_rank=0)["w"]) == sorted(replica_groups(layout, full))
    new_dev, new_map, new_full = _construct_tensor_layout_for_opt_shard([2, 2, 3], [0, 1], 6, 2, full)
    transform_rank1 = _load_tensor(ms.Tensor(arr.reshape(new_full)), new_dev, new_map, rank_id=1)
    assert not set(transform_rank1.ravel()) <= set(mp_rank1.ravel())


NESTED = [
    ((4, 2, 2), ((2, 1), 0)),
    ((2, 2, 2), ((0, 2), -1)),
    ((2, 2, 2, 2), (-1, (3, 1, 0))),
    ((2, 3, 2), ((1,), (2, 0))),
    ((2, 2, 2), ((1, 0),)),
]


@pytest.mark.parametrize("dev,tmap", NESTED)
def test_nested_maps_match_expand_layout(ms, dev, tmap):
    """A dim split over several device axes: MindSpore's ``_expand_layout`` + ``_load_tensor``."""
    from mindspore.parallel._tensor import _expand_layout, _load_tensor

    layout = TensorLayout(dev, tmap)
    assert layout.nested
    full = _full_shape(layout)
    arr = np.arange(math.prod(full), dtype=np.int32).reshape(full)
    lists = layout.tensor_map_lists()
    _, new_map, new_full = _expand_layout(list(dev), lists, list(full))
    tensor = ms.Tensor(arr.reshape(new_full))
    for rank in range(layout.device_num):
        expected = _load_tensor(tensor, list(dev), new_map, rank_id=rank).reshape(local_shape(layout, full))
        np.testing.assert_array_equal(arr[slice_for_rank(layout, full, rank).index], expected)


@pytest.mark.parametrize("dev,tmap,n", [((2, 2, 2), ((1, 0), -1), 2), ((4, 2, 2), ((1,), 0), 4), ((2, 2, 2), ((1,), -1), -1)])
def test_nested_with_opt_shard_matches_transform(ms, dev, tmap, n):
    from mindspore.parallel._tensor import _construct_tensor_layout_for_opt_shard, _load_tensor

    layout = TensorLayout(dev, tmap, 1, n)
    full = _full_shape(layout, local=(2, 3))
    arr = np.arange(math.prod(full), dtype=np.int32).reshape(full)
    new_dev, new_map, new_full = _construct_tensor_layout_for_opt_shard(list(dev), layout.tensor_map_lists(), 1, n, full)
    tensor = ms.Tensor(arr.reshape(new_full))
    for rank in range(layout.device_num):
        expected = _load_tensor(tensor, new_dev, new_map, rank_id=rank).reshape(local_shape(layout, full))
        np.testing.assert_array_equal(arr[slice_for_rank(layout, full, rank).index], expected)


def test_full_shape_from_local_matches_transform_inference(ms):
    """``_transform_parallel_checkpoint`` infers the full shape as local * strategy (* opt on dim 0)."""
    from mindspore.parallel._tensor import _extract_layout_item, _get_tensor_strategy

    for dev, tmap, n in _opt_layouts()[:40] + [(d, m, 0) for d, m in _flat_layouts(5)]:
        layout = TensorLayout(dev, tmap, 1 if n else 0, -1 if n == TensorLayout(dev, tmap).replica_count else n)
        local = tuple(range(2, 2 + len(tmap)))
        _, _, _, size = _extract_layout_item((list(dev), list(tmap), [], 0, layout.opt_shard_step, layout.opt_shard_size))
        strategy = _get_tensor_strategy(list(dev), list(tmap))
        expected = tuple(d * s * (size if i == 0 and size > 0 else 1) for i, (d, s) in enumerate(zip(local, strategy)))
        assert full_shape_from_local(layout, local) == expected
        assert local_shape(layout, expected) == local


def test_minus_one_resolves_to_whole_replica_group():
    full = (32, 4)
    for dev, tmap in [((2, 4), (0, -1)), ((2, 2, 2), (1, -1)), ((8,), (-1, -1))]:
        base = TensorLayout(dev, tmap)
        n = base.replica_count
        a = TensorLayout(dev, tmap, 1, -1)
        b = TensorLayout(dev, tmap, 1, n)
        assert a.opt_shard_count == n and a.split_counts == b.split_counts
        assert [slice_for_rank(a, full, r) for r in range(8)] == [slice_for_rank(b, full, r) for r in range(8)]
        assert all(len(g) == 1 for g in replica_groups(a, full))
        assert a.canonical() == b.canonical()


def test_step_formula_of_reference_doc_agrees_for_progressions():
    """The doc's part = (rank // step) % size holds whenever the replica group is an arithmetic
    progression (the usual dp x mp case)."""
    for dev, tmap, n in _opt_layouts():
        probe = TensorLayout(dev, tmap)
        full = _full_shape(probe, local=(n, 1, 1))
        group = replica_groups(probe, full)[0]
        if len({b - a for a, b in zip(group, group[1:])}) != 1:
            continue
        layout = TensorLayout(dev, tmap, _step(probe, full), n)
        chunk = full[0] // layout.split_counts[0]
        mp_chunk = full[0] // probe.split_counts[0]
        for rank in range(layout.device_num):
            part = (slice_for_rank(layout, full, rank).offsets[0] % mp_chunk) // chunk
            assert part == (rank // layout.opt_shard_step) % n


# --- properties ------------------------------------------------------------------------------


@st.composite
def layouts_and_shapes(draw):
    dev = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=4)))
    ndim = draw(st.integers(0, 3))
    axes = list(range(len(dev)))
    draw(st.randoms()).shuffle(axes)
    tmap: list = []
    for _ in range(ndim):
        take = draw(st.integers(0, min(2, len(axes))))
        chosen, axes = axes[:take], axes[take:]
        if not chosen:
            tmap.append(-1 if draw(st.booleans()) else (-1,))
        elif take == 1 and draw(st.booleans()):
            tmap.append(chosen[0])
        else:
            tmap.append(tuple(chosen))
    base = TensorLayout(dev, tmap)
    n = 0
    if ndim and base.replica_count > 1 and draw(st.booleans()):
        divisors = [d for d in range(2, base.replica_count + 1) if base.replica_count % d == 0]
        n = draw(st.sampled_from(divisors + [-1]))
    layout = TensorLayout(dev, tmap, 1 if n else 0, n)
    local = tuple(draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))
    return layout, full_shape_from_local(layout, local)


@settings(max_examples=300, deadline=None)
@given(layouts_and_shapes())
def test_slices_tile_the_full_tensor(case):
    layout, full = case
    groups = replica_groups(layout, full)
    cover = np.zeros(full, dtype=np.int32)
    for group in groups:
        slices = {slice_for_rank(layout, full, r) for r in group}
        assert len(slices) == 1  # a replica group holds one slice
        (s,) = slices
        assert s.sizes == local_shape(layout, full)
        cover[s.index] += 1
    assert cover.min(initial=1) == 1 and cover.max(initial=1) == 1  # union = full, groups disjoint
    assert sorted(r for g in groups for r in g) == list(range(layout.device_num))
    assert len(groups) * math.prod(local_shape(layout, full)) == math.prod(full)
    assert len({len(g) for g in groups}) <= 1
    assert full_shape_from_local(layout, local_shape(layout, full)) == full
    a, b = (slice_for_rank(layout, full, r) for r in (0, layout.device_num - 1))
    if a != b:
        assert a.overlap(b) is None or a.numel == 0


# --- Slice helpers and errors -----------------------------------------------------------------


def test_slice_helpers():
    a = Slice((0, 2), (4, 4))
    b = Slice((2, 0), (4, 4))
    assert a.stop == (4, 6) and a.numel == 16
    assert a.overlap(b) == Slice((2, 2), (2, 2)) == b.overlap(a)
    assert a.overlap(Slice((4, 0), (1, 8))) is None
    assert a.overlap(b).relative_to(a) == Slice((2, 0), (2, 2))
    full = np.arange(64).reshape(8, 8)
    np.testing.assert_array_equal(full[a.index], full[0:4, 2:6])
    with pytest.raises(LayoutError):
        b.relative_to(a)
    with pytest.raises(LayoutError):
        a.overlap(Slice((0,), (1,)))
    with pytest.raises(LayoutError):
        Slice((0, -1), (1, 1))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dev_matrix=(2, 0), tensor_map=(0,)),
        dict(dev_matrix=(2, -4), tensor_map=(0,)),
        dict(dev_matrix=(2, 4), tensor_map=(2,)),  # axis beyond dev_matrix
        dict(dev_matrix=(2, 4), tensor_map=(-2,)),
        dict(dev_matrix=(2, 4), tensor_map=(0, 0)),  # axis used twice
        dict(dev_matrix=(2, 4), tensor_map=((1, 0), 0)),
        dict(dev_matrix=(2, 4), tensor_map=((),)),
        dict(dev_matrix=(2, 4), tensor_map=((-1, 0),)),
        dict(dev_matrix=(2, 4), tensor_map=("0",)),
        dict(dev_matrix=(2.0, 4), tensor_map=(0,)),
        dict(dev_matrix=(2, 4), tensor_map=(1,), opt_shard_step=4, opt_shard_size=0),
        dict(dev_matrix=(2, 4), tensor_map=(1,), opt_shard_step=0, opt_shard_size=2),
        dict(dev_matrix=(2, 4), tensor_map=(1,), opt_shard_step=1, opt_shard_size=3),  # 3 does not divide 4
        dict(dev_matrix=(2, 4), tensor_map=(1,), opt_shard_step=1, opt_shard_size=-2),
        dict(dev_matrix=(2, 4), tensor_map=(), opt_shard_step=1, opt_shard_size=2),
        dict(dev_matrix=(1 << 16, 1 << 16), tensor_map=(0,)),
    ],
)
def test_invalid_layouts(kwargs):
    with pytest.raises(LayoutError):
        TensorLayout(**kwargs)


def test_shape_errors():
    layout = TensorLayout((2, 4), (1, 0))
    with pytest.raises(LayoutError, match="not divisible"):
        local_shape(layout, (3, 8))
    with pytest.raises(LayoutError, match="dims"):
        local_shape(layout, (4,))
    with pytest.raises(LayoutError):
        local_shape(layout, (4, -8))
    with pytest.raises(LayoutError, match="local rank"):
        slice_for_rank(layout, (4, 8), 8)
    with pytest.raises(LayoutError, match="uneven"):
        local_shape(TensorLayout((2,), (0,), param_split_shape=(3, 1), indices_offset=(0, 3)), (4,))
    opt = TensorLayout((4, 2), (0, -1), 2, 4)
    with pytest.raises(LayoutError, match="not divisible"):
        local_shape(opt, (2, 3))  # dim 0 needs 2 (mp) * 4 (opt)
    assert local_shape(opt, (8, 3)) == (1, 3)


def test_scalar_and_empty_dev_matrix():
    scalar = TensorLayout((2, 2), ())
    assert local_shape(scalar, ()) == () and replica_groups(scalar, ()) == [(0, 1, 2, 3)]
    single = TensorLayout((), (-1, -1))
    assert single.device_num == 1 and slice_for_rank(single, (3, 5), 0) == Slice((0, 0), (3, 5))
