"""Property tests of the re-sharding planner and executor over random layouts and shapes.

Sources here are written with ckptd's writer (byte-identical to ``mindspore.save_checkpoint``, see
test_ckpt_format.py) so that hypothesis can afford many examples; the MindSpore differential
lives in test_convert.py.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.convert import ConvertError, convert, plan_conversion
from ckptd.convert.plan import ShardEntry, SourceShard
from ckptd.format.checkpoint import open_checkpoint, write_checkpoint
from ckptd.format.layout import TensorLayout, slice_for_rank
from ckptd.format.strategy import ParamStrategy, Strategy


@st.composite
def layouts(draw, ndim: int, max_devices: int = 8):
    """A random valid MindSpore layout for an ``ndim`` tensor (with optional optimizer shard)."""
    nax = draw(st.integers(1, 3))
    dev = []
    for _ in range(nax):
        dev.append(draw(st.sampled_from([1, 2, 4])))
        while math.prod(dev) > max_devices:
            dev[-1] //= 2
    axes = list(range(nax)) + [-1] * ndim
    tmap = []
    for _ in range(ndim):
        m = draw(st.sampled_from(axes))
        if m != -1:
            axes.remove(m)
        tmap.append(m)
    base = TensorLayout(tuple(dev), tuple(tmap))
    if ndim and base.replica_count > 1 and draw(st.booleans()):
        divisors = [d for d in range(2, base.replica_count + 1) if base.replica_count % d == 0]
        size = draw(st.sampled_from([-1] + divisors))
        return TensorLayout(tuple(dev), tuple(tmap), opt_shard_step=1, opt_shard_size=size)
    return base


@st.composite
def cases(draw):
    """(full tensors, source layouts, destination layouts) for 1-3 parameters."""
    n = draw(st.integers(1, 3))
    src, dst, dtypes = {}, {}, {}
    for i in range(n):
        ndim = draw(st.integers(0, 3))
        src[f"p{i}"], dst[f"p{i}"] = draw(layouts(ndim)), draw(layouts(ndim))
        dtypes[f"p{i}"] = draw(st.sampled_from(["<f4", "<f2", "<i8", "u1"]))
    # every layout of one strategy must span the same device count: pad with a leading axis
    src, dst = _same_devices(src), _same_devices(dst)
    full = {}
    for name in src:
        a, b = src[name], dst[name]
        shape = tuple(math.lcm(x, y) * draw(st.integers(1, 2)) for x, y in zip(a.split_counts, b.split_counts))
        full[name] = np.arange(math.prod(shape), dtype=np.int64).astype(dtypes[name]).reshape(shape)
    return full, src, dst


def _same_devices(layouts_: dict[str, TensorLayout]) -> dict[str, TensorLayout]:
    top = max(lay.device_num for lay in layouts_.values())
    out = {}
    for name, lay in layouts_.items():
        if lay.device_num == top:
            out[name] = lay
            continue
        extra = top // lay.device_num  # dev axes are powers of two, so this divides
        out[name] = TensorLayout((extra,) + lay.dev_matrix, lay.tensor_map, opt_shard_step=lay.opt_shard_step,
                                 opt_shard_size=lay.opt_shard_size if lay.opt_shard_size != -1 else -1)
    return out


def _strategy(layouts_: dict[str, TensorLayout]) -> Strategy:
    return Strategy.build([ParamStrategy(n, lay) for n, lay in layouts_.items()])


def _inventory(full, strategy: Strategy) -> list[SourceShard]:
    shards = []
    for rank in range(strategy.world_size):
        entries = []
        for e in strategy.entries:
            s = slice_for_rank(e.layout, full[e.name].shape, rank)
            arr = full[e.name]
            entries.append(ShardEntry(e.name, "Float32", s.sizes, s.numel * 4))
            del arr
        shards.append(SourceShard(rank, f"rank_{rank}", tuple(entries)))
    return shards


@settings(max_examples=150, deadline=None)
@given(cases())
def test_plan_pieces_tile_every_destination_slice_from_the_right_source(case):
    full, src_l, dst_l = case
    src, dst = _strategy(src_l), _strategy(dst_l)
    plan = plan_conversion(_inventory(full, src), src, dst)
    assert [r.rank for r in plan.ranks] == list(range(dst.world_size))
    for rp in plan.ranks:
        for task in rp.tasks:
            shape = full[task.name].shape
            assert task.full_shape == shape
            assert task.dst_slice == slice_for_rank(dst_l[task.name], shape, rp.rank)
            covered = np.zeros(task.dst_slice.sizes, dtype=np.int32)
            for p in task.pieces:
                covered[p.dst_region.index + (Ellipsis,)] += 1
                src_slice = slice_for_rank(src_l[task.name], shape, p.src_rank)
                # the piece's source region and destination region are the same full-tensor elements
                src_abs = tuple(a + b for a, b in zip(src_slice.offsets, p.src_region.offsets))
                dst_abs = tuple(a + b for a, b in zip(task.dst_slice.offsets, p.dst_region.offsets))
                assert src_abs == dst_abs and p.src_region.sizes == p.dst_region.sizes
            assert (covered == 1).all()


def _write_sources(root: Path, full, strategy: Strategy, tamper=None) -> None:
    for rank in range(strategy.world_size):
        items = []
        for e in strategy.entries:
            s = slice_for_rank(e.layout, full[e.name].shape, rank)
            part = full[e.name][s.index + (Ellipsis,)].copy()
            items.append((e.name, tamper(rank, e.name, part) if tamper else part))
        (root / f"rank_{rank}").mkdir(parents=True)
        write_checkpoint(root / f"rank_{rank}" / "m-1_1.ckpt", items + [("step_num", 1)], crc=rank % 2 == 0)


def _read(path: Path) -> dict[str, np.ndarray]:
    with open_checkpoint(path) as cf:
        return {n: np.array(cf.array(n)) for n in cf.entries}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_convert_equals_ground_truth_and_merges_to_the_full_tensors(case):
    full, src_l, dst_l = case
    src, dst = _strategy(src_l), _strategy(dst_l)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write_sources(root / "src", full, src)
        convert(root / "src", src, None, root / "merged", workers=2)
        merged = _read(root / "merged" / "rank_0" / "checkpoint_0.ckpt")
        for name, arr in full.items():
            assert merged[name].dtype == arr.dtype and np.array_equal(merged[name], arr)
        convert(root / "src", src, dst, root / "dst", workers=3)
        for rank in range(dst.world_size):
            got = _read(root / "dst" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
            assert int(got["step_num"]) == 1
            for name, arr in full.items():
                want = arr[slice_for_rank(dst_l[name], arr.shape, rank).index]
                assert np.array_equal(got[name], want)


MUTATIONS = ["drop_dst", "drop_src", "indivisible", "wrong_shard_shape", "dst_json_shape"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from(MUTATIONS))
def test_mismatched_strategies_are_refused_before_any_output(case, mutation):
    full, src_l, dst_l = case
    src = _strategy(src_l)
    name = min(full)
    dst_entries = [ParamStrategy(n, lay) for n, lay in dst_l.items()]
    src_for_files, tamper = src, None
    if mutation == "drop_dst":
        dst_entries = [e for e in dst_entries if e.name != name]
        if not dst_entries:
            dst_entries = [ParamStrategy("other", TensorLayout(dst_l[name].dev_matrix, (-1,)))]
    elif mutation == "drop_src":
        src = Strategy.build([e for e in src.entries if e.name != name]) if len(src.entries) > 1 else None
        # unsharded source claimed: only works if the files really are unsharded
        if src is None and all(lay.device_num == 1 for lay in src_l.values()):
            return
    elif mutation == "indivisible":  # a 3-way split of a dim that 3 does not divide
        nd = len(full[name].shape)
        if nd == 0 or full[name].shape[0] % 3 == 0:
            return
        dst_entries = [ParamStrategy(e.name, TensorLayout((3,) + e.layout.dev_matrix,
                                                          (len(e.layout.dev_matrix),) + (-1,) * (nd - 1))
                                     if e.name == name else
                                     TensorLayout((3,) + e.layout.dev_matrix, e.layout.tensor_map,
                                                  opt_shard_step=e.layout.opt_shard_step,
                                                  opt_shard_size=e.layout.opt_shard_size))
                       for e in dst_entries]
    elif mutation == "wrong_shard_shape":  # one rank's shard does not match the others'
        if not full[name].shape or src.world_size < 2:
            return

        def tamper(rank, pname, part):
            if rank == 1 and pname == name:
                return np.zeros((part.shape[0] + 1,) + part.shape[1:], part.dtype)
            return part
    else:  # JSON tensor_shape that disagrees with the files
        dst_entries = [ParamStrategy(e.name, e.layout, tensor_shape=tuple(d + 8 for d in full[e.name].shape) or (8,))
                       if e.name == name else e for e in dst_entries]
    try:
        dst = Strategy.build(dst_entries)
    except Exception:  # noqa: BLE001 -- any refusal by the strategy layer ends this example
        return  # the mutation made an invalid strategy object: the strategy layer refuses it
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            _write_sources(root / "src", full, src_for_files, tamper)
        except Exception:  # noqa: BLE001 -- the tampered shard cannot even be written: nothing to test
            return
        with pytest.raises(ConvertError):
            convert(root / "src", src, dst, root / "out")
        assert not (root / "out").exists()


def _lie(layout: TensorLayout, kind: str) -> TensorLayout | None:
    """The layout a lying strategy claims for a parameter really laid out as ``layout``:
    ``replica_as_split`` splits an unsplit dim over a device axis the parameter is replicated on
    (tp2 x dp2 files read as tp4); ``split_as_replica`` drops a split (tp4 files read as tp2 x
    dp2). None if the layout offers no such change (or is optimizer-sharded)."""
    if layout.opt_shard_active:
        return None
    tmap = list(layout.tensor_map)
    used = {m for m in tmap if m != -1}
    if kind == "replica_as_split":
        free = [m for m in range(len(layout.dev_matrix)) if m not in used and layout.dev_matrix[-1 - m] > 1]
        dims = [d for d, m in enumerate(tmap) if m == -1]
        if not free or not dims:
            return None
        tmap[dims[0]] = free[0]
    else:
        split = [d for d, m in enumerate(tmap) if m != -1 and layout.dev_matrix[-1 - m] > 1]
        if not split:
            return None
        tmap[split[0]] = -1
    return TensorLayout(layout.dev_matrix, tuple(tmap))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cases(), st.sampled_from(["replica_as_split", "split_as_replica"]))
def test_a_strategy_lying_about_replicas_is_refused(case, kind):
    """Shapes cannot expose these lies (every shard has the shape the lie implies for some larger
    or smaller tensor); the bytes do: claimed replicas differ, or claimed different slices are
    bit-identical in two or more float parameters."""
    from hypothesis import assume

    full, src_l, _ = case
    full = {n: a.astype(np.float32) + 1 for n, a in full.items()}  # non-constant, distinct float data
    lied = {n: lay for n, lay in ((n, _lie(lay, kind)) for n, lay in src_l.items()) if lay is not None}
    need = 2 if kind == "replica_as_split" else 1
    # a lied parameter must have more than one element per shard, or its bytes prove nothing
    lied = {n: lay for n, lay in lied.items() if math.prod(slice_for_rank(src_l[n], full[n].shape, 0).sizes) > 1}
    assume(len(lied) >= need)
    claim = _strategy({**src_l, **lied})
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write_sources(root / "src", full, _strategy(src_l))
        with pytest.raises(ConvertError, match="does not describe the source files") as info:
            convert(root / "src", claim, None, root / "out")
        assert not (root / "out").exists()
        what = "holds the same bytes as rank" if kind == "replica_as_split" else "holds other bytes than rank"
        assert what in str(info.value)
