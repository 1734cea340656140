"""Do the source files match the source strategy? Checked before anything is planned (pure).

A strategy of another job than the one that wrote the files (tp2 x dp2 files under a tp4
strategy, per-stage files under a pp=1 strategy, ...) makes a re-shard put the wrong bytes in the
right places, and the executor's verification cannot notice: it checks copies, not meaning. So
:func:`check_sources` runs first and collects *every* disagreement, per rank, into one
:class:`ConvertError` (as PyTorch DCP reports per-rank failures), before any output exists:

* a source rank beyond the strategy's world (or beyond ``rank_0`` for an unsharded source);
* for every source rank and every parameter the strategy assigns to that rank's stage: the
  rank's file holds it (a rank lacking it is not papered over by reading a replica), with exactly
  the slice shape the strategy implies, and the full shape inferred from each rank (local shape x
  split counts, or JSON ``tensor_shape``) is the same on every rank and stage
  (:func:`~ckptd.format.layout.full_shape_from_local` / :func:`~ckptd.format.layout.local_shape`,
  the rule of the daemon's ``stepcheck._check_shapes``);
* every rank holding a parameter holds it with the same dtype.

Headers cannot expose every lie: tp2 x dp2 shards read as tp4 shards of tensors twice as large
have every shape "right". The inventory therefore carries a digest of the first bytes of every
tensor (:attr:`ShardEntry.probe`; plaintext sources only, one page per tensor), and

* ranks the strategy says hold the same slice (replicas) must hold the same bytes, as they do in
  MindSpore training (the daemon's step check relies on that too);
* ranks the strategy says hold *different* slices must not hold bit-identical, non-constant
  floating-point data in two or more parameters -- the signature of data-parallel replicas read
  as tensor-parallel ranks. A single such parameter is only noted (a coincidence is possible in
  principle); constant data (fresh biases, moments at step 0) and integer buffers are never
  taken as evidence.

Missing ranks are not problems here: the planner reads replicas instead and refuses only when a
block it needs has none (that error names the missing ranks).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from ckptd.convert.plan_types import ConvertError, ShardEntry, SourceShard
from ckptd.errors import LayoutError
from ckptd.format.layout import Slice, TensorLayout, full_shape_from_local, local_shape, slice_for_rank
from ckptd.format.strategy import ParamStrategy, Strategy

#: dtypes whose bit-identical data in two different slices is taken as evidence of a lie
EVIDENCE_DTYPES = frozenset({"Float16", "Float32", "Float64", "BFloat16"})
#: parameters that must show such twins before the strategy is refused (fewer: a note)
MIN_TWIN_PARAMS = 2
#: payload bytes of each tensor digested by ``sources.read_inventory`` and looked at to tell a
#: constant one (one page: ~free for mmap'd files; zero-initialised moments are equal everywhere)
PROBE_BYTES = 4096


def repeats_one_element(data: bytes, itemsize: int) -> bool:
    """``data`` is one element repeated (such equal bytes in two slices prove nothing)."""
    return data == data[:itemsize] * (len(data) // itemsize)
MAX_LISTED = 20  # problem lines in one error
_NAMES_LISTED = 4  # parameter names in one line
HINT = ("pass the strategy file the source job saved with (strategy_ckpt_save_file; a pipeline job's "
        "per-rank files as their directory), and check that --src/--step pick that job's checkpoints")


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_NAMES_LISTED])
    more = len(names) - _NAMES_LISTED
    return f"{len(names)} parameter(s) {shown}" + (f" and {more} more" if more > 0 else "") if len(names) > 1 \
        else repr(names[0])


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
    return ", ".join(out)


def check_sources(shards: Mapping[int, SourceShard], src: Strategy | None, *, subset: bool = False) -> list[str]:
    """Notes about the sources (things that are fine); raises :class:`ConvertError` listing every
    disagreement between ``src`` and what ``shards`` hold. ``subset``: a rank may hold only some
    of its stage's parameters (a Checkpoint 2.0 balanced save, whose metadata.json says who holds
    what); the planner then reads each slice from a rank that holds it, or refuses."""
    general: list[str] = []
    world = src.world_size if src is not None else 1
    extra = sorted(r for r in shards if not 0 <= r < world)
    if extra:
        what = ("is unsharded (--src-strategy none): only rank_0 is read" if src is None
                else f"covers ranks 0..{world - 1}")
        general.append(f"source rank(s) {extra} found but the source strategy {what} (world-size mismatch)")
    if src is None:
        _raise(general, {}, None)
        return []
    dev = src.stage_device_num
    index = {r: {e.name: e for e in s.entries} for r, s in shards.items() if 0 <= r < world}
    per_rank: dict[int, list[str]] = defaultdict(list)
    bad_dtype = _check_dtypes(index, src, per_rank)
    fulls, bad = _check_shapes(index, src, per_rank, subset)
    notes = _check_bytes(index, src, dev, fulls, bad | bad_dtype, per_rank)
    _raise(general, per_rank, src.source_path)
    return notes


def _raise(general: list[str], per_rank: Mapping[int, list[str]], path: str | None) -> None:
    per_rank = {r: lines for r, lines in per_rank.items() if lines}
    if not general and not per_rank:
        return
    lines = general + [f"rank {r}: " + "; ".join(per_rank[r]) for r in sorted(per_rank)]
    shown = lines[:MAX_LISTED]
    more = len(lines) - len(shown)
    where = f" on rank(s) {ranks_text(per_rank)}" if per_rank else ""
    text = "; ".join(shown) + (f"; ... and {more} more" if more > 0 else "")
    raise ConvertError(f"the source strategy does not describe the source files ({len(lines)} problem(s){where}): "
                       f"{text}", path=path, hint=HINT)


def _check_dtypes(index: Mapping[int, Mapping[str, ShardEntry]], src: Strategy,
                  per_rank: dict[int, list[str]]) -> set[str]:
    first: dict[str, tuple[str, int]] = {}
    bad: set[str] = set()
    for r in sorted(index):
        for name, ent in index[r].items():
            if name not in src.params:
                continue
            dtype, r0 = first.setdefault(name, (ent.dtype, r))
            if ent.dtype != dtype:
                per_rank[r].append(f"{name!r} is {ent.dtype} but rank {r0} holds it as {dtype}")
                bad.add(name)
    return bad


def _check_shapes(index: Mapping[int, Mapping[str, ShardEntry]], src: Strategy, per_rank: dict[int, list[str]],
                  subset: bool = False) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Each rank holds its stage's parameters at the slice shape the strategy implies; returns the
    full shapes the ranks agree on and the parameters found inconsistent."""
    dev = src.stage_device_num
    by_stage: dict[int, list[ParamStrategy]] = defaultdict(list)
    for e in src.entries:
        by_stage[e.stage].append(e)
    fulls: dict[str, tuple[tuple[int, ...], int]] = {}
    bad: set[str] = set()
    # ranks of a stage share layouts: the slice math runs once per (parameter, stage, stored shape)
    memo: dict[tuple[str, int, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]] | str] = {}
    for r in sorted(index):
        stage = r // dev
        lacking: list[str] = []
        found_problems: list[str] = []
        for e in by_stage.get(stage, ()):
            ent = index[r].get(e.name)
            if ent is None:
                if not subset:
                    lacking.append(e.name)
                    bad.add(e.name)
                continue
            key = (e.name, stage, tuple(ent.shape))
            if key not in memo:
                try:
                    full = tuple(e.tensor_shape) if e.tensor_shape is not None else \
                        full_shape_from_local(e.layout, ent.shape)
                    memo[key] = (full, local_shape(e.layout, full))
                except LayoutError as err:
                    memo[key] = err.message
            got = memo[key]
            if isinstance(got, str):
                found_problems.append(f"{e.name!r} {list(ent.shape)} does not fit the strategy's layout: {got}")
                bad.add(e.name)
                continue
            full, want = got
            seen, r0 = fulls.setdefault(e.name, (full, r))
            if seen != full:
                found_problems.append(f"{e.name!r} {list(ent.shape)} implies full shape {list(full)}, "
                                      f"rank {r0}'s implies {list(seen)}")
                bad.add(e.name)
            elif tuple(ent.shape) != want:
                found_problems.append(f"{e.name!r} has shape {list(ent.shape)}, the strategy's slice of "
                                      f"{list(full)} is {list(want)}")
                bad.add(e.name)
        if lacking:
            per_rank[r].append(f"lacks {_names(lacking)} that the strategy puts in its stage {stage}")
        if found_problems:
            per_rank[r].extend(found_problems)
    return {n: f for n, (f, _) in fulls.items()}, bad


def _check_bytes(index: Mapping[int, Mapping[str, ShardEntry]], src: Strategy, dev: int,
                 fulls: Mapping[str, tuple[int, ...]], bad: set[str], per_rank: dict[int, list[str]]) -> list[str]:
    """Replicas hold equal bytes; different slices do not hold equal (non-constant float) bytes."""
    differ: dict[tuple[int, int], list[str]] = defaultdict(list)  # (rank, its replica) -> parameters
    twins: dict[tuple[int, int], list[str]] = defaultdict(list)  # (rank, rank of other slice) -> parameters
    slices: dict[tuple[TensorLayout, tuple[int, ...]], list[Slice]] = {}
    stage_ranks: dict[int, list[int]] = defaultdict(list)
    for r in sorted(index):
        stage_ranks[r // dev].append(r)
    for e in src.entries:
        if e.name in bad or e.name not in fulls:
            continue
        holders = [(r, ent) for r in stage_ranks.get(e.stage, ()) if (ent := index[r].get(e.name)) is not None
                   and ent.probe is not None]
        if len(holders) < 2:
            continue
        full = fulls[e.name]
        key = (e.layout, full)
        if key not in slices:
            slices[key] = [slice_for_rank(e.layout, full, lr) for lr in range(dev)]
        of_rank = slices[key]
        replica: dict[Slice, tuple[int, bytes | None]] = {}
        same: dict[bytes | None, tuple[int, Slice]] = {}
        evidence = holders[0][1].dtype in EVIDENCE_DTYPES
        for r, ent in holders:
            s = of_rank[r % dev]
            r0, probe0 = replica.setdefault(s, (r, ent.probe))
            if probe0 != ent.probe:
                differ[(r, r0)].append(e.name)
            if evidence and not ent.constant:
                r1, s1 = same.setdefault(ent.probe, (r, s))
                if s1 != s:
                    twins[(r, r1)].append(e.name)
    for (r, r0), names in sorted(differ.items()):
        per_rank[r].append(f"holds other bytes than rank {r0} in {_names(names)} although the strategy says both "
                           "hold the same slice (tensor-parallel ranks read as replicas, or replicas that diverged?)")
    notes: list[str] = []
    twin_params = {n for names in twins.values() for n in names}
    for (r, r1), names in sorted(twins.items()):
        text = (f"holds the same bytes as rank {r1} in {_names(names)} although the strategy gives the two ranks "
                "different slices")
        if len(twin_params) >= MIN_TWIN_PARAMS:
            per_rank[r].append(text + " (data-parallel replicas read as tensor-parallel ranks?)")
        else:
            notes.append(f"source rank {r} {text}; a coincidence in one parameter is not taken as proof")
    return notes
