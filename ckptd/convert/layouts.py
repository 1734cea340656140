"""``--to-layout tp=..,dp=..[,pp=..]``: derive the destination strategy from the source one.

A strategy file is the only complete description of a layout, but when a job restarts on a new
tensor/data-parallel degree the operator usually has no file for the new layout yet. For the
common transformer case -- every parameter split along at most one tensor dim, by the
tensor-parallel axis -- the new layout follows mechanically. The rule (pure, documented, tested):

* Source: every parameter's tensor map must split at most one tensor dim over device axes of total
  size > 1, and all split parameters must use the same split count (the source ``tp``).
  Otherwise -> :class:`ConvertError` (pass a real ``--to-strategy``).
* Destination ``dev_matrix = (dp, tp)``; a parameter split along dim ``i`` in the source is split
  along dim ``i`` by the tp axis (``tensor_map[i] = 0``), all other dims are whole (-1).
  Unsplit parameters stay replicated. From a source without any split (tp=1) only ``tp=1`` can be
  derived: which dim to split is model knowledge the files do not carry.
* Optimizer sharding (``opt_weight_shard_size``) is kept per parameter: ``-1`` stays ``-1`` (the
  whole replica group), ``n > 0`` stays ``n`` and must divide the new replica group (dp for split
  parameters, dp*tp for replicated ones); ``opt_weight_shard_step`` is set to the stride of that
  group as MindSpore records it (tp for split parameters, 1 for replicated ones). With a replica
  group of one the parameter is not optimizer-sharded.
* Pipeline: ``pp`` must equal the source's stage count (each parameter keeps its stage);
  re-partitioning layers between stages needs the model, not the checkpoint.
"""

from __future__ import annotations

from ckptd import split as split_rules
from ckptd.convert.plan import ConvertError
from ckptd.format.layout import TensorLayout, slice_for_rank
from ckptd.format.strategy import OpItem, ParamStrategy, Strategy

#: the largest world a split may have (:mod:`ckptd.split`, the one grammar of ``tp=..,dp=..[,pp=..]``)
MAX_WORLD_SIZE = split_rules.MAX_WORLD_SIZE


def _split_dim(e: ParamStrategy) -> tuple[int | None, int]:
    """(the one tensor dim the parameter is split along, its split count) or (None, 1)."""
    counts = e.layout.mp_split_counts
    split = [i for i, c in enumerate(counts) if c > 1]
    if len(split) > 1:
        raise ConvertError(
            f"parameter {e.name!r} is split along dims {split} (tensor_map {e.layout.tensor_map_lists()}); "
            "--to-layout handles parameters split along at most one dim",
            hint="pass the destination strategy file with --to-strategy",
        )
    return (split[0], counts[split[0]]) if split else (None, 1)


def _opt(e: ParamStrategy, replicas: int, stride: int) -> tuple[int, int]:
    size = e.layout.opt_shard_size
    if size == 0 or replicas == 1:
        return 0, 0
    if size == -1:
        return stride, -1
    if replicas % size:
        raise ConvertError(
            f"parameter {e.name!r}: opt_weight_shard_size {size} does not divide its new replica group of {replicas}",
            hint="pass the destination strategy file with --to-strategy",
        )
    return (stride, size) if size > 1 else (0, 0)


def derive_strategy(src: Strategy, tp: int, dp: int, pp: int | None = None) -> Strategy:
    """The destination strategy for ``tp x dp (x pp)`` following the module's rule."""
    if tp < 1 or dp < 1:
        raise ConvertError(f"tp={tp}, dp={dp}: both must be positive")
    if pp is not None and pp != src.stages:
        raise ConvertError(
            f"pp={pp} but the source has {src.stages} pipeline stage(s)",
            hint="--to-layout keeps each parameter's stage; re-partitioning stages needs a --to-strategy file",
        )
    splits = {e.name: _split_dim(e) for e in src.entries}
    src_tp = {c for d, c in splits.values() if d is not None}
    if len(src_tp) > 1:
        raise ConvertError(
            f"parameters are split {sorted(src_tp)} ways: not a single tensor-parallel axis",
            hint="pass the destination strategy file with --to-strategy",
        )
    if tp > 1 and not src_tp:
        raise ConvertError(
            "the source splits no parameter, so which dims to split for tp > 1 is unknown",
            hint="pass the destination strategy file with --to-strategy",
        )
    entries = []
    for e in src.entries:
        dim, _ = splits[e.name]
        tmap = tuple(0 if i == dim else -1 for i in range(e.layout.ndim))
        replicas, stride = (dp, tp) if dim is not None else (dp * tp, 1)
        step, size = _opt(e, replicas, stride)
        layout = TensorLayout((dp, tp), tmap, opt_shard_step=step, opt_shard_size=size)
        entries.append(ParamStrategy(e.name, layout, e.stage))
    stages = sorted({e.stage for e in src.entries}) or [0]
    ops = [OpItem(f"ckptd/derived/stage{s}", s, ((dp, tp),)) for s in stages]
    return Strategy.build(entries, op_items=ops, merged=src.merged)


def same_placement(a: Strategy, b: Strategy) -> bool:
    """Whether ``a`` and ``b`` put every element of every parameter on the same ranks.

    Content hashes are not enough to tell "already in this layout": a file MindSpore wrote for tp=2
    has ``dev_matrix (2,)``, the derived one ``(1, 2)`` -- same placement, different hash. Full
    shapes are not in a strategy file, so each dim is taken as a multiple of every split count of
    either layout (the device count of both), which any real shape's slicing agrees with.
    """
    if (a.stages, a.stage_device_num) != (b.stages, b.stage_device_num):
        return False
    ea = {(e.stage, e.name): e.layout for e in a.entries}
    eb = {(e.stage, e.name): e.layout for e in b.entries}
    if ea.keys() != eb.keys():
        return False
    for key, la in ea.items():
        lb = eb[key]
        if la.ndim != lb.ndim or la.device_num != lb.device_num:
            return False
        shape = (la.device_num * lb.device_num,) * la.ndim
        for rank in range(la.device_num):
            if slice_for_rank(la, shape, rank) != slice_for_rank(lb, shape, rank):
                return False
    return True
