"""The whole job's layout from per-rank strategy files (MindFormers under pipeline parallelism).

MindFormers makes every rank save ``<run>/strategy/<base>_rank_<r>.ckpt``. A rank's file holds
only its pipeline stage's parameters (the stage of its operator items, see
:mod:`ckptd.format.strategy_types`); without pipeline parallelism all files are the same. The
whole layout is their merge, what ``mindspore.merge_pipeline_strategys(dir, dst)`` writes, and
:func:`merge_rank_strategies` computes the same :class:`Strategy` without MindSpore.

What MindSpore's merge does, and what we do differently (mindspore 2.10,
``_merge_protobuf_strategy`` / ``_merge_json_strategy``):

* It globs ``*.ckpt`` (else ``*.json``) in listing order, drops byte-identical duplicates, takes
  each file's stage from its first operator item and keeps the *first* file seen of every stage;
  later files of that stage are skipped unread. Files of one stage that disagree are not noticed,
  so which one wins depends on the directory order. We compare them all and refuse disagreement.
* It never checks ranks (file names mean nothing to it): a missing rank or a file copied to the
  wrong rank merge fine, a missing stage only fails later, when a loader counts stages. A file
  without operator items or parameter layouts stops it ("is empty"); ckptd reads the former as
  stage 0 (its parser's rule) and refuses the latter. We check every rank.
* A parameter shared between stages (a tied embedding) is kept once per stage, each copy
  prefixed with its stage ("0-embed", "1-embed"): no deduplication. So do we.
* The merged file's operator items are every kept file's items concatenated (JSON: a dict update,
  so equal node names collapse); ``current_stage`` is 1. Entries follow the listing order; ours
  follow stage order (lowest rank's file of each stage), which only changes the order of items.

Every problem is collected and raised in one :class:`StrategyError`, so an operator fixing a
strategy directory sees all of it at once.
"""

from __future__ import annotations

import json
import numbers
import os
from typing import Iterable, Mapping

from ckptd.storage import beneath
from ckptd.errors import StrategyError
from ckptd.format.layout import TensorLayout
from ckptd.format.limits import DEFAULT_STRATEGY_LIMITS, StrategyLimitError, StrategyLimits
from ckptd.format.strategy import MAX_STRATEGY_BYTES, Strategy, parse_strategy_bytes
from ckptd.runlayout import rank_strategy_rank

__all__ = ["load_rank_strategies", "merge_rank_strategies"]

# Which names are per-rank files is ckptd.runlayout's rule (rank_strategy_rank): merge_pipeline_strategys'
# own output (merged_ckpt_strategy*.ckpt) and MindFormers' merge_succeed.txt share the directory.
_READ_CHUNK = 1 << 20


# --- merge -----------------------------------------------------------------------------------


class _Problems:
    """What is wrong, with one hint per kind of problem (several problems often share one)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.hints: list[str] = []

    def add(self, message: str, hint: str) -> None:
        self.items.append(message)
        if hint not in self.hints:
            self.hints.append(hint)

    def raise_if_any(self, where: str | None) -> None:
        if not self.items:
            return
        if len(self.items) == 1:
            message = self.items[0]
        else:
            message = f"{len(self.items)} problems: " + "; ".join(f"({i}) {m}" for i, m in enumerate(self.items, 1))
        raise StrategyError(message, path=where, hint="; ".join(self.hints))


def merge_rank_strategies(
    per_rank: Mapping[int, Strategy],
    where: str | os.PathLike[str] | None = None,
    *,
    world_size: int | None = None,
) -> Strategy:
    """One :class:`Strategy` for the whole job from each global rank's (unmerged) strategy file.

    One stage: the common file's strategy (every rank's file must hold the same layouts). Several
    stages: a merged strategy (``merged=True``) with every stage's entries, as
    ``merge_pipeline_strategys`` would write it. ``where`` (the directory) goes into errors;
    by default the files' common directory. Raises one :class:`StrategyError` naming every
    missing rank, misplaced file, disagreeing pair, missing stage and devices-per-stage conflict.

    The stage count comes from the highest stage a file holds, so files alone cannot show that
    the *last* stages are missing entirely; pass ``world_size`` when the job's rank count is known
    otherwise (e.g. from its ``rank_<r>`` checkpoint directories) to have that checked too.
    """
    place = os.fspath(where) if where is not None else _common_dir(per_rank.values())
    problems = _Problems()
    if not per_rank:
        problems.add("no per-rank strategy files", "the job writes <run>/strategy/<base>_rank_<r>.ckpt; "
                     "wait until it compiled its graph, or point at the directory holding them")
        problems.raise_if_any(place)

    # rank -> (its stage, its strategy); files that cannot take part are reported and left out
    files: dict[int, tuple[int, Strategy]] = {}
    for rank, s in per_rank.items():
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or rank < 0:
            problems.add(f"{rank!r} is not a global rank", "global ranks are integers >= 0")
        elif not isinstance(s, Strategy):
            problems.add(f"rank {rank}: {type(s).__name__} is not a parsed Strategy", "parse it with load_strategy")
        elif s.merged:
            problems.add(f"rank {rank}: {_name(s)} is already a merged strategy",
                         "pass each rank's own file (<base>_rank_<r>.ckpt), not merge_pipeline_strategys' output")
        elif not s.entries:
            problems.add(f"rank {rank}: {_name(s)} holds no parameter layouts, so it says nothing of its stage's "
                         "devices", "re-save it; MindSpore's merge_pipeline_strategys refuses such a file too")
        else:
            files[int(rank)] = (s.entries[0].stage, s)  # unmerged: every entry has the file's stage

    by_stage: dict[int, list[int]] = {}
    for rank in sorted(files):
        by_stage.setdefault(files[rank][0], []).append(rank)
    reps = {stage: _agree(stage, ranks, files, problems) for stage, ranks in sorted(by_stage.items())}

    devices = _devices_per_stage(reps, by_stage, problems)
    stages = max(by_stage, default=-1) + 1
    if world_size is not None and devices is not None:
        stages = _stages_of_world(world_size, stages, devices, problems)
    absent = [st for st in range(stages) if st not in by_stage]
    if absent:
        span = ""
        if devices is not None:  # name the ranks that would hold them
            span = " (ranks " + ", ".join(_ranks(range(st * devices, (st + 1) * devices)) for st in absent) + ")"
        problems.add(f"no file holds pipeline stage{'s' if len(absent) > 1 else ''} {_list(absent)}{span}",
                     "merge_pipeline_strategys needs a file of every pipeline stage: copy the missing stages' files "
                     "from the nodes that ran them")
    if devices is not None:
        _check_ranks(per_rank, files, stages, devices, absent, problems)
    problems.raise_if_any(place)

    if stages == 1:
        return reps[0]
    return Strategy.build(
        [e for st in range(stages) for e in reps[st].entries],
        op_items=[op for st in range(stages) for op in reps[st].op_items],
        current_stage=1,  # what merge_pipeline_strategys writes
        format=_common_format(reps.values()),
        source_path=place,
        merged=True,
    )


def _agree(stage: int, ranks: list[int], files: dict[int, tuple[int, Strategy]], problems: _Problems) -> Strategy:
    """The stage's strategy; reports every file of the stage whose layouts differ from it.

    The reference is the content most ranks hold (ties: the lowest rank's), so one stale file
    among many is named as the odd one, not the other way round."""
    groups: dict[str, list[int]] = {}
    for rank in ranks:
        groups.setdefault(files[rank][1].content_hash(), []).append(rank)  # layouts + devices, not op items
    ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
    ref_rank = ordered[0][0]
    ref = files[ref_rank][1]
    for group in ordered[1:]:
        other = files[group[0]][1]
        name, ours, theirs = _first_difference(ref, other)
        also = f" (as do {_ranks(group[1:])})" if len(group) > 1 else ""
        problems.add(
            f"stage {stage}: rank {group[0]} ({_name(other)}) and rank {ref_rank} ({_name(ref)}) disagree on "
            f"{name!r}: {theirs} vs {ours}{also}",
            "all ranks of a pipeline stage save the same strategy file: a differing one is left over from "
            "another run or layout; remove the stale files and let the job re-save them",
        )
    return ref


def _first_difference(a: Strategy, b: Strategy) -> tuple[str, str, str]:
    """The first parameter (by name) whose layout differs between ``a`` and ``b``, described in each."""
    la = {e.name: e.layout for e in a.entries}
    lb = {e.name: e.layout for e in b.entries}
    for name in sorted(la.keys() | lb.keys()):
        x, y = la.get(name), lb.get(name)
        if x is None or y is None or x.canonical() != y.canonical():
            return name, _describe(x), _describe(y)
    raise AssertionError("content hashes differ but no layout does")  # content_hash covers exactly these


def _devices_per_stage(reps: dict[int, Strategy], by_stage: dict[int, list[int]], problems: _Problems) -> int | None:
    counts = {st: s.stage_device_num for st, s in reps.items()}
    if len(set(counts.values())) <= 1:
        return next(iter(counts.values()), None)
    problems.add(
        "stages span different numbers of devices: "
        + ", ".join(f"stage {st}: {n} (ranks {_ranks(by_stage[st])})" for st, n in sorted(counts.items()))
        + "; ranks are not checked, their stages are ambiguous",
        "every stage of one job has the same devices per stage (prod(dev_matrix)): files of another "
        "parallel layout are mixed in; remove them",
    )
    return None


def _stages_of_world(world_size: int, stages: int, devices: int, problems: _Problems) -> int:
    """The stage count a known world size implies (checked against what the files hold)."""
    if world_size <= 0 or world_size % devices:
        problems.add(f"a world of {world_size} ranks is not a positive multiple of the files' {devices} devices "
                     "per stage", "check the world size given, or remove files of another layout")
    elif world_size // devices < stages:
        problems.add(f"the files hold {stages} stages x {devices} devices = {stages * devices} ranks, more than the "
                     f"job's {world_size}", "remove strategy files left over from a larger job")
    else:
        return world_size // devices
    return stages


def _check_ranks(per_rank, files, stages: int, devices: int, absent: list[int], problems: _Problems) -> None:
    world = stages * devices
    present = {int(r) for r in per_rank if isinstance(r, numbers.Integral) and not isinstance(r, bool)}
    missing = [r for r in range(world) if r not in present and r // devices not in absent]  # absent: said above
    if missing:
        problems.add(
            f"rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} ha{'ve' if len(missing) > 1 else 's'} no "
            f"strategy file ({stages} stage{'s' if stages > 1 else ''} x {devices} devices = ranks 0-{world - 1})",
            "every rank writes its own strategy file: copy the missing ones from the nodes that ran those ranks",
        )
    for rank, (stage, s) in sorted(files.items()):
        if rank // devices != stage:
            why = " (it has no operator items, so it reads as stage 0)" if not s.op_items else ""
            problems.add(
                f"rank {rank}: {_name(s)} holds stage {stage}{why}, but with {devices} devices per stage rank {rank} "
                f"belongs to stage {rank // devices}",
                "rank r belongs to stage r // devices-per-stage: a file was copied or renamed to the wrong rank; "
                "restore each rank's own file",
            )


# --- small helpers ---------------------------------------------------------------------------


def _name(s: Strategy) -> str:
    return os.path.basename(s.source_path) if s.source_path else "its file"


def _common_dir(strategies: Iterable[object]) -> str | None:
    dirs = {os.path.dirname(s.source_path) for s in strategies if isinstance(s, Strategy) and s.source_path}
    return dirs.pop() if len(dirs) == 1 else None


def _common_format(strategies: Iterable[Strategy]):
    formats = {s.format for s in strategies}
    return formats.pop() if len(formats) == 1 else "proto"  # mixed: MindSpore itself only merges protobuf or JSON


def _list(values: Iterable[int]) -> str:
    return ", ".join(map(str, values))


def _ranks(ranks: Iterable[int]) -> str:
    """``0-3, 6, 8-9``: a thousand missing ranks stay readable."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _describe(layout: TensorLayout | None) -> str:
    if layout is None:
        return "absent"
    c = layout.canonical()
    text = f"dev_matrix {c['dev_matrix']} tensor_map {json.dumps(c['tensor_map'])}"
    if c["opt_shard_size"]:
        text += f" opt_shard {c['opt_shard_step']}/{c['opt_shard_size']}"
    for key in ("field", "param_split_shape", "indices_offset"):
        if c[key]:
            text += f" {key} {c[key]}"
    return text


# --- loading a directory ---------------------------------------------------------------------


def load_rank_strategies(
    directory: str | os.PathLike[str], *, limits: StrategyLimits | None = None
) -> dict[int, Strategy]:
    """Parse every ``<base>_rank_<r>.(ckpt|json)`` file of ``directory``: ``{rank: Strategy}``.

    Only regular files are read, and never through a symlink: a FIFO or device under a strategy
    name must not block or feed the daemon. Every unreadable, damaged or duplicated rank file is
    reported in one :class:`StrategyError`. ``limits`` (default: ckptd.format.limits' constants)
    bound each file; the directory holds at most ``max_items`` files (one per rank)."""
    where = os.fspath(directory)
    try:
        names = sorted(os.listdir(where))
    except OSError as err:
        raise StrategyError(f"cannot list the strategy directory: {err.strerror or err}", path=where,
                            hint="pass the directory holding the per-rank strategy files (<run>/strategy)") from None
    by_rank: dict[int, list[str]] = {}
    for name in names:
        rank = rank_strategy_rank(name)
        if rank is not None:
            by_rank.setdefault(rank, []).append(name)
    parse_limits = limits or DEFAULT_STRATEGY_LIMITS
    if len(by_rank) > parse_limits.max_items:
        raise StrategyLimitError(f"{len(by_rank)} ranks' strategy files: more than ckptd's limit of "
                                 f"{parse_limits.max_items}", path=where)
    problems = _Problems()
    out: dict[int, Strategy] = {}
    for rank, files in sorted(by_rank.items()):
        if len(files) > 1:
            problems.add(f"rank {rank} has several strategy files: {', '.join(files)}",
                         "keep one file per rank (the one the current job wrote)")
            continue
        path = os.path.join(where, files[0])
        try:
            data = _read_regular(path, MAX_STRATEGY_BYTES if limits is None else limits.max_bytes)
            out[rank] = parse_strategy_bytes(data, path=path, limits=parse_limits)
        except StrategyError as err:
            problems.add(f"{files[0]}: {err.message}" + (f" @ byte {err.offset}" if err.offset is not None else ""),
                         err.hint)
    problems.raise_if_any(where)
    return out


def _read_regular(path: str, max_bytes: int) -> bytes:
    """The bytes of a regular file of the strategy directory, opened by ckptd's one confinement
    rule (``ckptd.storage.beneath``: no symlink, no FIFO or device, never blocks), within ``max_bytes``."""
    try:
        fd = beneath.open_beneath(os.path.dirname(path), path)
    except beneath.ConfinementError:
        raise _not_regular(path) from None
    except OSError as err:
        raise StrategyError(f"cannot read strategy file: {err.strerror or err}", path=path) from None
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise StrategyLimitError(f"{size} bytes is too large for a strategy file (ckptd's limit is "
                                     f"{max_bytes} bytes)", path=path)
        chunks, total = [], 0
        while chunk := os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # grew while we read
                raise StrategyLimitError(f"more than {max_bytes} bytes: too large for a strategy file", path=path)
        return b"".join(chunks)
    except OSError as err:
        raise StrategyError(f"cannot read strategy file: {err.strerror or err}", path=path) from None
    finally:
        os.close(fd)


def _not_regular(path: str) -> StrategyError:
    return StrategyError("not a regular file (symlink, FIFO, device or directory)", path=path,
                         hint="strategy files are plain files the trainer writes; ckptd does not follow links")
