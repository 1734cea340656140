"""Shared builders for the convert tests: layouts, strategy files and MindSpore-written sources.

Ground truth is a dict of full numpy tensors; source rank files hold ``full[slice_for_rank(...)]``
written by ``mindspore.save_checkpoint`` (ckptd's slice math is checked against MindSpore's
``_load_tensor`` in test_layout.py). Each helper returns plain data so tests stay declarative.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ckptd.format.checkpoint import open_checkpoint
from ckptd.format.dtypes import float32_to_bf16
from ckptd.format.layout import TensorLayout, slice_for_rank
from ckptd.format.strategy import OpItem, ParamStrategy, Strategy, save_strategy

#: full shapes of the toy model; every dim divisible by 8 where a split may land
SHAPES = {
    "embedding": (32, 8),
    "w1": (16, 8),
    "w2": (8, 16),
    "bias": (16,),
    "ln": (8,),
    "adam_m.w1": (16, 8),
    "adam_v.w1": (16, 8),
    "adam_m.ln": (8,),
}
#: which tensor dim each parameter splits over tp (None: replicated)
SPLIT_DIM = {"embedding": 0, "w1": 0, "w2": 1, "bias": 0, "ln": None, "adam_m.w1": 0, "adam_v.w1": 0, "adam_m.ln": None}
#: pipeline stage of each parameter when pp=2
PP_STAGE = {"embedding": 0, "w1": 0, "adam_m.w1": 0, "adam_v.w1": 0, "w2": 1, "bias": 1, "ln": 1, "adam_m.ln": 1}
BF16 = {"w2"}


def full_tensors(seed: int = 0, names=SHAPES) -> dict[str, np.ndarray]:
    """Float32 ground truth (BFloat16 params as raw uint16 bits of bf16-exact values)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in names:
        shape = SHAPES[name]
        values = (rng.integers(-512, 512, size=shape) / 8).astype(np.float32)  # exact in bf16 too
        out[name] = float32_to_bf16(values) if name in BF16 else values
    return out


def tp_layout(name: str, dp: int, tp: int, opt: int = 0, axis_order: str = "dp,tp") -> TensorLayout:
    """MindSpore's dp x tp layout of ``name``; ``opt`` = optimizer shard size (-1 = whole group)."""
    ndim = len(SHAPES[name])
    tmap = [-1] * ndim
    if SPLIT_DIM[name] is not None:
        tmap[SPLIT_DIM[name]] = 0 if axis_order == "dp,tp" else 1
    dev = (dp, tp) if axis_order == "dp,tp" else (tp, dp)
    layout = TensorLayout(dev, tuple(tmap))
    if opt and layout.replica_count > 1:
        step = tp if (SPLIT_DIM[name] is not None and axis_order == "dp,tp") else 1
        size = opt if opt != -1 else -1
        layout = TensorLayout(dev, tuple(tmap), opt_shard_step=step, opt_shard_size=size)
    return layout


@dataclass(frozen=True)
class Spec:
    """A parallel configuration of the toy model."""

    tp: int
    dp: int = 1
    pp: int = 1
    opt: int = 0  # optimizer shard size for adam_* (0 off, -1 whole group)
    axis_order: str = "dp,tp"

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def label(self) -> str:
        extra = f",opt={self.opt}" if self.opt else ""
        extra += ",tp-first" if self.axis_order != "dp,tp" else ""
        return f"tp{self.tp}dp{self.dp}pp{self.pp}{extra}"


def build_strategy(spec: Spec, names=SHAPES) -> Strategy:
    entries = []
    for name in names:
        opt = spec.opt if name.startswith("adam_") else 0
        stage = PP_STAGE[name] if spec.pp == 2 else 0
        entries.append(ParamStrategy(name, tp_layout(name, spec.dp, spec.tp, opt, spec.axis_order), stage))
    ops = [OpItem(f"Default/network-stage{s}/MatMul-op{s}", s, ((spec.dp, spec.tp),)) for s in range(spec.pp)]
    return Strategy.build(entries, op_items=ops, merged=spec.pp > 1)


def write_strategy(spec: Spec | None, path: Path, names=SHAPES) -> str | None:
    if spec is None:
        return None
    save_strategy(build_strategy(spec, names), path)
    return str(path)


def ms_tensor(ms, name: str, arr: np.ndarray):
    if name in BF16:
        from ckptd.format.dtypes import bf16_to_float32

        return ms.Tensor(bf16_to_float32(arr), dtype=ms.bfloat16)
    return ms.Tensor(arr)


def write_sources(ms, root: Path, spec: Spec | None, full: dict[str, np.ndarray], *, step_name: str = "net-1_10.ckpt",
                  extras: bool = True, rank_id: bool = True, names=SHAPES) -> None:
    """``root/rank_<r>/<step_name>`` for every rank of ``spec`` (None: one unsharded rank_0)."""
    strategy = build_strategy(spec, names) if spec is not None else None
    world = spec.world if spec is not None else 1
    for rank in range(world):
        items = []
        if strategy is None:
            items = [(n, full[n]) for n in names]
        else:
            stage, local = strategy.stage_and_local(rank)
            for e in strategy.entries:
                if e.stage == stage:
                    s = slice_for_rank(e.layout, full[e.name].shape, local)
                    items.append((e.name, np.ascontiguousarray(full[e.name][s.index])))
        data = [{"name": n, "data": ms_tensor(ms, n, a)} for n, a in items]
        if extras:
            data.append({"name": "global_step", "data": ms.Tensor(np.array([10 + rank % 2], np.int32))})
        append = {"epoch_num": 1, "step_num": 10}
        if rank_id:
            append["rank_id"] = rank
        d = root / f"rank_{rank}"
        d.mkdir(parents=True, exist_ok=True)
        ms.save_checkpoint(data, str(d / step_name), append_dict=append if extras else None)


def read_dir(out: Path, key: bytes | None = None) -> dict[int, dict[str, tuple[str, bytes, tuple]]]:
    """``{rank: {name: (dtype, raw bytes, shape)}}`` of a converted directory (any format)."""
    result: dict[int, dict] = {}
    for d in sorted(out.iterdir()):
        if not d.name.startswith("rank_"):
            continue
        files = [f for f in d.iterdir() if f.suffix in (".ckpt", ".safetensors")]
        assert len(files) == 1, files
        with open_checkpoint(files[0], key) as cf:
            entries = {}
            for name, e in cf.entries.items():
                if e.dtype == "str":
                    entries[name] = (e.dtype, cf.value(name).encode(), ())
                else:
                    entries[name] = (e.dtype, cf.array(name).tobytes(), tuple(e.shape))
        result[int(d.name[5:])] = entries
    return result


def expected_rank(spec: Spec | None, full: dict[str, np.ndarray], rank: int, names=SHAPES) -> dict[str, bytes]:
    """What ``rank`` of ``spec`` must hold (raw bytes), from the ground truth."""
    if spec is None:
        return {n: np.ascontiguousarray(full[n]).tobytes() for n in names}
    strategy = build_strategy(spec, names)
    stage, local = strategy.stage_and_local(rank)
    return {
        e.name: np.ascontiguousarray(full[e.name][slice_for_rank(e.layout, full[e.name].shape, local).index]).tobytes()
        for e in strategy.entries
        if e.stage == stage
    }


def test_helpers_build_consistent_sources(ms, tmp_path):
    """The builders themselves: each rank file holds exactly its slices, readable by ckptd."""
    spec = Spec(tp=2, dp=2, opt=2)
    full = full_tensors(1)
    write_sources(ms, tmp_path / "src", spec, full)
    got = read_dir(tmp_path / "src")
    assert sorted(got) == [0, 1, 2, 3]
    for rank, entries in got.items():
        want = expected_rank(spec, full, rank)
        assert {n: entries[n][1] for n in want} == want
        assert entries["w2"][0] == "BFloat16"
    assert os.path.isfile(write_strategy(spec, tmp_path / "s.ckpt"))
