"""The pure half of re-sharding: which bytes of which source shard land where in which output.

``plan_conversion`` takes only *metadata* -- the entries (name, dtype, local shape) each source
rank's file holds and the two strategies -- and returns a frozen :class:`ConversionPlan`: for every
destination rank, every tensor it will hold and the list of :class:`Piece` copies (source rank,
region of that source shard, region of the destination slice) that tile it exactly. No file is
opened here, so ``--plan`` costs nothing, the executor can trust every region, and every
impossible conversion is refused *before* a byte is written.

Rules (the same as ``mindspore.transform_checkpoints`` unless said otherwise):

* Slices are those MindSpore's *training* stores (:func:`ckptd.format.layout.slice_for_rank`).
  Where MindSpore's transform renumbers ranks differently (optimizer-sharded layouts whose only
  repeated device axis is axis 0 and whose tensor map is not in device-axis order) ckptd follows
  training, i.e. what a resumed job will load.
* Full shapes are inferred from the source shards (local shape x split counts), checked against
  every source shard holding the parameter and against JSON ``tensor_shape`` when present.
* A parameter shared by several source pipeline stages is read from its lowest stage.
* Source shards are sliced into a grid (equal blocks per dim); a destination slice reads exactly
  the blocks it overlaps, from one replica each (preferring ranks it already reads, then the rank
  with its own local rank, then the lowest). Missing source ranks are fine while a replica exists.
* Entries in no strategy (``global_step``, ``epoch_num``, learning rate, ...) are copied whole from
  source rank ``stage0 * src_stage_devices + (dst_local_rank % src_stage_devices)`` (``stage0`` =
  lowest source stage the destination rank reads), like MindSpore -- EXCEPT an entry named
  ``rank_id``, which is set to the destination rank (ckptd's daemon checks it against the file).
* Before anything else, the source files must be what the source strategy says they are
  (:mod:`ckptd.convert.consistency`: per rank, every parameter of its stage at the implied slice
  shape, one dtype, replicas bit-equal, no replicas read as tensor-parallel ranks); all
  disagreements are refused in one error.
* Refused (:class:`ConvertError`): a parameter in one strategy but not the other (MindSpore would
  silently copy a wrong local shard), in both strategies but in no source file, shards that
  disagree on shape/dtype, non-divisible splits, ranks outside the strategies, single-stage
  strategy files of a stage > 0 (merge them first), MapTensor and Int4 parameters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from ckptd.convert.consistency import check_sources
from ckptd.convert.plan_types import (  # re-exported: ckptd.convert.plan is where callers import them from
    CHUNK_BYTES,
    MAP_TENSOR_TYPE,
    RANK_ID_ENTRY,
    ConversionPlan,
    ConvertError,
    Piece,
    RankPlan,
    ShardEntry,
    SourceShard,
    TaskKind,
    TensorTask,
    estimate_peak,
)
from ckptd.errors import LayoutError
from ckptd.format.dtypes import MS_DTYPES, STR_TYPE, itemsize
from ckptd.format.layout import Slice, TensorLayout, full_shape_from_local, local_shape, slice_for_rank
from ckptd.format.strategy import Strategy

__all__ = [
    "CHUNK_BYTES", "MAP_TENSOR_TYPE", "RANK_ID_ENTRY", "ConversionPlan", "ConvertError", "Piece", "RankPlan",
    "ShardEntry", "SourceShard", "TaskKind", "TensorTask", "check_output_bytes", "least_output_bytes",
    "output_bytes_bound", "plan_conversion",
]

_MAX_LISTED = 12  # problems listed in one ConvertError

#: The default bound on a conversion's output: this many times the bytes of its source step. A
#: re-layout moves slices around (about 1x); more data-parallel replicas of unsharded parameters
#: multiply them (dp=8 from dp=1: 8x); 64x is a 64-fold growth of the replicated part, far beyond
#: any elastic restart, while a typo (dp=2000 of a 2-rank step: ~1,900x) is refused before it fills
#: the disk and holds the job queue.
MAX_OUTPUT_FACTOR = 64
_OUTPUT_HINT = ("check the target layout: every destination rank holds its own copy of each replicated "
                "parameter, so dp=N writes them N times; convert only the ranks needed if that is intended")


def output_bytes_bound(source_bytes: int) -> int:
    """The most a conversion of a step whose files hold ``source_bytes`` may write unless told
    otherwise: :data:`MAX_OUTPUT_FACTOR` times them. The one rule, applied by the planner (exactly,
    from the files' entries) and by the API before it queues a job (from the catalog, through
    :func:`least_output_bytes`), both through :func:`check_output_bytes`."""
    return MAX_OUTPUT_FACTOR * source_bytes


def check_output_bytes(total: int, source_bytes: int, dst_ranks: int, limit: int | None = None, *,
                       estimated: bool = False) -> None:
    """Refuse (:class:`ConvertError`) writing ``total`` bytes to ``dst_ranks`` destination ranks from
    a step of ``source_bytes``: more than ``limit`` (default :func:`output_bytes_bound`).
    ``estimated``: ``total`` is :func:`least_output_bytes`'s estimate, said so in the message."""
    basis = f" ({MAX_OUTPUT_FACTOR} x the source step's {source_bytes} bytes)" if limit is None else ""
    limit = output_bytes_bound(source_bytes) if limit is None else limit
    if total > limit:
        raise ConvertError(
            f"the conversion would write {'about ' if estimated else ''}{total} bytes to {dst_ranks} destination "
            f"ranks, more than its bound of {limit} bytes{basis}",
            hint=_OUTPUT_HINT,
        )


def least_output_bytes(source_bytes: int, src: Strategy, dst: Strategy) -> int:
    """A lower bound on what :func:`plan_conversion` finds a conversion from ``src`` to ``dst``
    writes, from the two strategies and the size of the source step's files alone (no file opened:
    the API checks a request with it before it queues a job).

    Every element of a parameter is held by ``stage ranks / split count`` ranks of each stage the
    parameter is in; the planner counts the destination's that way, and the source's files hold at
    most that many copies (at most the model-parallel slice per rank: optimizer shards may have been
    merged on save; a missing rank or a redundancy-free save holds fewer). Entries in no strategy go
    to every destination rank and come from at most every source rank. So the output is at least
    the smallest ratio of destination to source copies, over all parameters and entries, times the
    source's entry bytes. Given the files' bytes instead (the catalog's shard sizes: entries plus a
    few bytes of framing each) the estimate is that ratio times them, and comparing it with
    :func:`output_bytes_bound` of the same bytes refuses only when the ratio exceeds
    :data:`MAX_OUTPUT_FACTOR`: never a conversion the planner would accept."""
    def copies(strategy: Strategy, splits) -> dict[str, Fraction]:
        out: dict[str, Fraction] = {}
        for e in strategy.entries:
            out[e.name] = out.get(e.name, Fraction(0)) + Fraction(strategy.stage_device_num,
                                                                   max(1, math.prod(splits(e.layout))))
        return out

    held = copies(src, lambda lay: lay.mp_split_counts)
    written = copies(dst, lambda lay: lay.split_counts)
    ratios = [Fraction(dst.world_size, max(1, src.world_size))]
    ratios += [written[n] / held[n] for n in written.keys() & held.keys() if held[n]]
    return math.floor(min(ratios) * source_bytes)


# --- helpers ---------------------------------------------------------------------------------


def _trivial(ndim: int) -> TensorLayout:
    return TensorLayout(dev_matrix=(1,), tensor_map=(-1,) * ndim)


def _fail(problems: Sequence[str], hint: str | None = None) -> ConvertError:
    problems = list(dict.fromkeys(problems))  # one message per problem, not per rank
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    text = "; ".join(shown) + (f"; ... and {more} more" if more > 0 else "")
    return ConvertError(f"impossible conversion: {text}", hint=hint)


def _check_stage_file(strategy: Strategy | None, which: str) -> None:
    if strategy is None or strategy.merged:
        return
    stages = {e.stage for e in strategy.entries}
    if stages - {0}:
        raise ConvertError(
            f"the {which} strategy is the file of pipeline stage {max(stages)} alone",
            path=strategy.source_path,
            hint="merge the strategy files of all stages first (mindspore.merge_pipeline_strategys)",
        )


@dataclass(frozen=True)
class _Source:
    """Where a layout parameter is read from: one stage's layout and the holders of each block."""

    name: str
    dtype: str
    full_shape: tuple[int, ...]
    block: tuple[int, ...]  # source shard shape
    stage: int
    blocks: Mapping[tuple[int, ...], tuple[int, ...]]  # block index -> global ranks holding it (present)
    missing: Mapping[tuple[int, ...], tuple[int, ...]]  # block index -> ranks of the strategy (for errors)


def _grid(layout: TensorLayout, full: tuple[int, ...], block: tuple[int, ...], stage: int, dev: int,
          have: set[int], cache: dict) -> tuple[dict, dict]:
    key = (layout, full)
    if key not in cache:
        owners: dict[tuple[int, ...], list[int]] = {}
        for lr in range(layout.device_num):
            s = slice_for_rank(layout, full, lr)
            idx = tuple(o // b if b else 0 for o, b in zip(s.offsets, block))
            owners.setdefault(idx, []).append(lr)
        cache[key] = owners
    present: dict[tuple[int, ...], tuple[int, ...]] = {}
    every: dict[tuple[int, ...], tuple[int, ...]] = {}
    for idx, locals_ in cache[key].items():
        ranks = tuple(stage * dev + lr for lr in locals_)
        every[idx] = ranks
        present[idx] = tuple(r for r in ranks if r in have)
    return present, every


# --- the planner -----------------------------------------------------------------------------


def plan_conversion(
    sources: Iterable[SourceShard],
    src: Strategy | None,
    dst: Strategy | None,
    *,
    ranks: Sequence[int] | None = None,
    subset: bool = False,
    max_output_bytes: int | None = None,
) -> ConversionPlan:
    """Plan converting ``sources`` (laid out by ``src``; None = one unsharded file in rank 0) to
    ``dst`` (None = one unsharded file). ``ranks`` restricts the destination ranks planned;
    ``subset``: ranks may hold only part of their stage (see ``consistency.check_sources``).
    ``max_output_bytes`` bounds what the destination ranks would hold (default
    :data:`MAX_OUTPUT_FACTOR` times the sources' bytes), checked before any rank is planned.

    Raises :class:`ConvertError` listing every problem found.
    """
    shards = {s.rank: s for s in sources}
    _check_stage_file(src, "source")
    _check_stage_file(dst, "destination")
    src_dev = src.stage_device_num if src is not None else 1
    src_world = src.world_size if src is not None else 1
    dst_dev = dst.stage_device_num if dst is not None else 1
    dst_world = dst.world_size if dst is not None else 1
    problems: list[str] = []
    notes: list[str] = []

    if not shards:
        raise ConvertError("no source checkpoints found", hint="the source directory needs rank_<N>/ sub-directories")
    # the files must be what the source strategy says they are: every disagreement, per rank
    notes.extend(check_sources(shards, src, subset=subset))
    absent = sorted(set(range(src_world)) - set(shards))
    if absent:
        notes.append(f"source rank(s) {absent} have no checkpoint; replicas are read instead where they exist")

    # file order over all shards: output files keep the order the sources had
    order: dict[str, int] = {}
    for r in sorted(shards):
        for e in shards[r].entries:
            order.setdefault(e.name, len(order))
    holders: dict[str, list[int]] = {}
    for r in sorted(shards):
        for e in shards[r].entries:
            holders.setdefault(e.name, []).append(r)

    src_names = set(src.params) if src is not None else set()
    dst_names = {e.name for e in dst.entries} if dst is not None else set()
    in_files = set(holders)
    if src is not None:
        layout_names = src_names & in_files
        if dst is not None:
            for n in sorted(dst_names - src_names):
                problems.append(f"parameter {n!r} is in the destination strategy but not in the source strategy")
            for n in sorted(layout_names - dst_names):
                problems.append(f"parameter {n!r} is in the source strategy and files but not in the destination strategy")
            for n in sorted((dst_names & src_names) - in_files):
                problems.append(f"parameter {n!r} is in both strategies but in no source checkpoint")
    else:
        layout_names = dst_names & in_files
        for n in sorted(dst_names - in_files):
            problems.append(f"parameter {n!r} is in the destination strategy but not in the unsharded source")
    if problems:
        raise _fail(problems)

    # --- where each layout parameter comes from ---
    cache: dict = {}
    have_by_name = {n: set(holders[n]) for n in layout_names}
    psrc: dict[str, _Source] = {}
    for name in sorted(layout_names, key=order.__getitem__):
        try:
            psrc[name] = _locate(name, src, shards, have_by_name[name], src_dev, cache)
        except ConvertError as err:
            problems.append(err.message)
    if problems:
        raise _fail(problems)
    nonlayout = [n for n in sorted(in_files - layout_names, key=order.__getitem__)]
    for n in nonlayout:
        e = shards[holders[n][0]].get(n)
        if e is not None and e.dtype == MAP_TENSOR_TYPE:
            problems.append(f"entry {n!r} is a MapParameter, which ckptd cannot re-shard or copy")
        elif e is not None and e.dtype not in MS_DTYPES and e.dtype != STR_TYPE:
            problems.append(f"entry {n!r} has unknown dtype {e.dtype!r}")
    if problems:
        raise _fail(problems)

    # --- bounded before a destination rank is planned: planning and writing cost per rank, so a
    # typo such as dp=999999 would plan for ever (memory growing) and dp=2000 write 1,900x the step
    _check_output_bytes(shards, psrc, nonlayout, holders, dst, dst_dev, ranks, max_output_bytes)

    # --- destination ranks ---
    if dst is None:
        all_ranks = [0]
    else:
        stages = sorted({e.stage for e in dst.entries}) or [0]
        all_ranks = [s * dst_dev + lr for s in stages for lr in range(dst_dev)]
    if ranks is not None:
        bad = sorted({r for r in ranks if r not in all_ranks})
        if bad:
            raise ConvertError(
                f"destination rank(s) {bad} outside the destination layout's ranks 0..{max(all_ranks)}",
                hint="--rank must be a rank of the destination strategy",
            )
        todo = sorted(set(ranks))
    else:
        todo = all_ranks

    plans = []
    for r in todo:
        try:
            plans.append(_plan_rank(r, dst, dst_dev, src_dev, psrc, nonlayout, shards, holders, order))
        except ConvertError as err:
            problems.append(err.message)
            if len(problems) >= _MAX_LISTED:
                break
    if problems:
        raise _fail(problems)
    return ConversionPlan(
        src_world=src_world,
        src_stage_devices=src_dev,
        dst_world=dst_world,
        dst_stage_devices=dst_dev,
        ranks=tuple(plans),
        src_files={r: s.path for r, s in shards.items()},
        notes=tuple(notes),
        src_strategy_hash=src.content_hash() if src is not None else None,
        dst_strategy_hash=dst.content_hash() if dst is not None else None,
        layout_params=tuple(psrc),
    )


def _check_output_bytes(shards: Mapping[int, SourceShard], psrc: Mapping[str, _Source], nonlayout: Sequence[str],
                        holders: Mapping[str, list[int]], dst: Strategy | None, dst_dev: int,
                        ranks: Sequence[int] | None, limit: int | None) -> None:
    """Refuse a conversion whose destination ranks would hold more than ``limit`` bytes. Costs a
    pass over the parameters per destination *stage*, never per rank: every rank of a stage holds
    equal slices (even splits), and entries outside the strategy are copied whole to every rank."""
    source_bytes = sum(e.nbytes for s in shards.values() for e in s.entries)
    whole = sum(shards[holders[n][0]].get(n).nbytes for n in nonlayout)  # type: ignore[union-attr]
    if dst is None:
        per_stage, counts = {0: sum(math.prod(p.full_shape) * itemsize(p.dtype) for p in psrc.values())}, {0: 1}
    else:
        per_stage = {}
        for e in dst.entries:
            p = psrc.get(e.name)
            if p is not None:
                numel = math.prod(p.full_shape) // max(1, math.prod(e.layout.split_counts))
                per_stage[e.stage] = per_stage.get(e.stage, 0) + numel * itemsize(p.dtype)
        stages = sorted({e.stage for e in dst.entries}) or [0]
        wanted = None if ranks is None else set(ranks)
        counts = {s: dst_dev if wanted is None else sum(1 for r in wanted if r // dst_dev == s) for s in stages}
    total = sum(n * (per_stage.get(s, 0) + whole) for s, n in counts.items())
    check_output_bytes(total, source_bytes, sum(counts.values()), limit)


def _locate(name: str, src: Strategy | None, shards: Mapping[int, SourceShard], have: set[int], src_dev: int,
            cache: dict) -> _Source:
    """Pick the source stage of ``name``, infer and check its full shape, map its block grid."""
    first = shards[min(have)].get(name)
    assert first is not None
    for r in sorted(have):
        e = shards[r].get(name)
        assert e is not None
        if (e.dtype, e.shape) != (first.dtype, first.shape):
            raise ConvertError(
                f"parameter {name!r}: rank {min(have)} holds {first.dtype}{list(first.shape)} but rank {r} "
                f"holds {e.dtype}{list(e.shape)}"
            )
    if first.dtype == MAP_TENSOR_TYPE or first.dtype == STR_TYPE or first.dtype == "Int4":
        raise ConvertError(f"parameter {name!r} has dtype {first.dtype}, which cannot be re-sharded")
    if first.dtype not in MS_DTYPES:
        raise ConvertError(f"parameter {name!r} has unknown dtype {first.dtype!r}")
    if src is None:
        layout, stage, tensor_shape = _trivial(len(first.shape)), 0, None
    else:
        cands = sorted((e for e in src.entries if e.name == name), key=lambda e: e.stage)
        chosen = next((e for e in cands if any(r // src_dev == e.stage for r in have)), None)
        if chosen is None:
            raise ConvertError(
                f"parameter {name!r} is found only in ranks {sorted(have)}, outside its stage(s) "
                f"{[e.stage for e in cands]} of the source strategy"
            )
        layout, stage, tensor_shape = chosen.layout, chosen.stage, chosen.tensor_shape
    try:
        full = full_shape_from_local(layout, first.shape)
    except LayoutError as err:
        raise ConvertError(f"parameter {name!r}: its source shard {list(first.shape)} does not fit the source "
                           f"strategy: {err.message}") from None
    if tensor_shape is not None and tuple(tensor_shape) != full:
        raise ConvertError(f"parameter {name!r}: source files imply full shape {list(full)} but the source "
                           f"strategy says {list(tensor_shape)}")
    in_stage = {r for r in have if r // src_dev == stage}
    present, every = _grid(layout, full, first.shape, stage, src_dev, in_stage, cache)
    return _Source(name, first.dtype, full, first.shape, stage, present, every)


def _choose(cands: tuple[int, ...], used: dict[int, None], preferred: int) -> int:
    for r in cands:
        if r in used:
            return r
    return preferred if preferred in cands else cands[0]


def _pieces(ps: _Source, dslice: Slice, used: dict[int, None], local: int, src_dev: int) -> tuple[Piece, ...]:
    if dslice.numel == 0:
        return ()
    ranges = []
    for off, size, b in zip(dslice.offsets, dslice.sizes, ps.block):
        ranges.append(range(off // b, (off + size - 1) // b + 1))
    out = []
    for idx in itertools.product(*ranges):
        block = Slice(tuple(i * b for i, b in zip(idx, ps.block)), ps.block)
        ov = block.overlap(dslice) if block.offsets else block
        if ov is None:  # cannot happen for a grid, but never copy garbage
            continue
        cands = ps.blocks.get(idx, ())
        if not cands:
            raise ConvertError(
                f"parameter {ps.name!r}: no source checkpoint holds block {list(block.offsets)}+{list(block.sizes)} "
                f"(it lives on missing source rank(s) {list(ps.missing.get(idx, ()))})"
            )
        src_rank = _choose(cands, used, ps.stage * src_dev + local % src_dev)
        used.setdefault(src_rank, None)
        out.append(Piece(src_rank, ov.relative_to(block), ov.relative_to(dslice), ps.block))
    if sum(p.dst_region.numel for p in out) != dslice.numel:
        raise ConvertError(f"parameter {ps.name!r}: source blocks do not tile destination slice {dslice}")
    return tuple(out)


def _plan_rank(rank: int, dst: Strategy | None, dst_dev: int, src_dev: int, psrc: Mapping[str, _Source],
               nonlayout: Sequence[str], shards: Mapping[int, SourceShard], holders: Mapping[str, list[int]],
               order: Mapping[str, int]) -> RankPlan:
    stage, local = divmod(rank, dst_dev)
    used: dict[int, None] = {}
    tasks: list[TensorTask] = []
    if dst is None:
        wanted = [(n, _trivial(len(ps.full_shape))) for n, ps in psrc.items()]
    else:
        wanted = [(e.name, e.layout) for e in dst.entries if e.stage == stage]
        for e in dst.entries:
            if e.stage == stage and e.tensor_shape is not None and tuple(e.tensor_shape) != psrc[e.name].full_shape:
                raise ConvertError(f"parameter {e.name!r}: destination strategy says full shape "
                                   f"{list(e.tensor_shape)}, the source files hold {list(psrc[e.name].full_shape)}")
    for name, layout in wanted:
        ps = psrc[name]
        try:
            local_shape(layout, ps.full_shape)
            dslice = slice_for_rank(layout, ps.full_shape, local)
        except LayoutError as err:
            raise ConvertError(f"parameter {name!r} (full shape {list(ps.full_shape)}) does not fit the "
                               f"destination strategy: {err.message}") from None
        tasks.append(TensorTask(name, ps.dtype, "reshard", ps.full_shape, dslice, _pieces(ps, dslice, used, local, src_dev)))
    stage0 = min((r // src_dev for r in used), default=0)
    designated = stage0 * src_dev + local % src_dev
    for name in nonlayout:
        cands = [designated] + sorted(used)
        src_rank = next((r for r in cands if r in shards and shards[r].get(name) is not None), None)
        if src_rank is None:
            if used:
                continue  # an entry only of files this rank does not read (MindSpore drops it too)
            src_rank = holders[name][0]
        e = shards[src_rank].get(name)
        assert e is not None
        whole = Slice((0,) * len(e.shape), e.shape)
        kind: TaskKind = "rank_id" if name == RANK_ID_ENTRY else "copy"
        pieces = () if kind == "rank_id" else (Piece(src_rank, whole, whole, e.shape),)
        if kind == "copy":
            used.setdefault(src_rank, None)
        tasks.append(TensorTask(name, e.dtype, kind, e.shape, whole, pieces))
    tasks.sort(key=lambda t: order[t.name])
    return RankPlan(
        rank=rank,
        stage=stage,
        local_rank=local,
        tasks=tuple(tasks),
        src_ranks=tuple(sorted(used)),
        bytes_out=sum(t.nbytes for t in tasks),
        bytes_read=sum(t.bytes_read for t in tasks),
        peak_bytes=estimate_peak(tasks),
    )

