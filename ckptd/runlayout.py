"""Where things live in a checkpoint root — the only module that knows checkpoint path rules.

A run is one directory under the root, in one of two layouts, told apart by the path's shape::

    native (ckptd's trainer, plain MindSpore jobs)
      <root>/<run>/rank_<r>/<name>                          a shard
      <root>/<run>/[strategy/]*strategy*.(ckpt|json)        the parallel strategy file
    mindformers (MindFormers 2.x legacy CheckpointMonitor; <run> = its output_dir)
      <root>/<run>/checkpoint/rank_<r>/<name>               a shard
      <root>/<run>/checkpoint/rank_<r>/meta.json            MindFormers' own resume hint (lags, can lie)
      <root>/<run>/strategy/<base>_rank_<r>.ckpt            one strategy file per rank (a stage's, under pp)
      <root>/<run>/strategy/merged_ckpt_strategy*.ckpt      merge_pipeline_strategys' output (sometimes)
      <root>/<run>/health_ckpts.json                        health records (is_health 1 = abnormal)
      <root>/<run>/checkpoint_network|checkpoint_trainable/ network-only copies: not training checkpoints
    mindformers2 (MindFormers Checkpoint 2.0, ``use_legacy_format=False``; one directory per save)
      <root>/<run>/checkpoint/iteration_<8 digits>/<P>-model-<i:07d>-<n:07d>.safetensors   model side, file i of n
      <root>/<run>/checkpoint/iteration_<8 digits>/<P>-opt-<i:07d>-<n:07d>.safetensors     optimizer side
      <root>/<run>/checkpoint/iteration_<8 digits>/common.json    step counters, ckpt_status (1 = abnormal)
      <root>/<run>/checkpoint/iteration_<8 digits>/metadata.json  every tensor's layout and file (world > 1)
      <root>/<run>/checkpoint/latest_checkpointed_iteration.txt   MindFormers' commit record (a hint: torn,
                                                                  dangling or stale in the field)

    <name>  = <file prefix>-<epoch>_<step>[_breakpoint].(ckpt|safetensors)
    <file prefix> = <P>[_rank_<r>][_<k>]
    <shard>.done                                           ckptd trainer's commit hint (JSON)
    ... .tmp / .ckptd-tmp / .part                          in-flight writes: never shards

``<step>`` counts within the epoch (MindSpore's ``ModelCheckpoint``); the global step is in the
file. MindFormers tags every rank's files ``{P}_rank_{r}`` and MindSpore appends ``_{k}`` to a
prefix that already has files in the directory (the k-th restart into it), in every layout;
``exception_save`` writes ``..._breakpoint`` with the prefix *without* the restart suffix. So a
step's identity across ranks is ``(P[_k], epoch, step)`` — the rank tag is dropped
(:attr:`ShardName.prefix`), the restart suffix kept — and ``k`` is the incarnation, 0 for the first
(a breakpoint's ``_n`` is a same-name counter instead: its incarnation is unknown). Without a rank
tag a name cannot tell ``_k`` from a user prefix ending in digits: see
:func:`ckptd.runnames.parse_shard_name`. Every number in a name is range-checked there
(:mod:`ckptd.runnames`) before it reaches the catalog. A rank tag that names another rank than the directory is kept in the
prefix: the file is misplaced and must not pass for that rank's shard.

A Checkpoint 2.0 iteration is one step (prefix ``iteration``, epoch 0, step = the iteration); its
files are its shards, numbered by :func:`iteration_slot` (file numbers are not ranks: a balanced save
numbers only the ranks that got shards, and model and optimizer sides are numbered separately).

The pure functions here classify and build paths; only :func:`rank_dirs` / :func:`shard_dirs` /
:func:`detect_layout` list a directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

# the name grammar and the bounds of every number in a name (re-exported: callers use runlayout)
from ckptd.runnames import (  # noqa: F401
    MAX_INCARNATION,
    MAX_RANK,
    MAX_STEP,
    SHARD_SUFFIXES,
    Role,
    is_rank_strategy_name,
    is_torn_temp_name,
    parse_iteration_dir,
    parse_rank_dir,
    parse_shard_name,
    rank_strategy_rank,
    read_iteration_file,
    unusable_dir,
    unusable_file_name,
)

Layout = Literal["native", "mindformers", "mindformers2"]
NATIVE: Layout = "native"
MINDFORMERS: Layout = "mindformers"
CKPT2: Layout = "mindformers2"
SIDECAR_SUFFIX = ".done"
MF_CHECKPOINT_DIR = "checkpoint"
MF_AUX_DIRS = ("checkpoint_network", "checkpoint_trainable")  # weights-only copies, no training state
MF_META = "meta.json"
MF_HEALTH = "health_ckpts.json"
STRATEGY_DIR = "strategy"
#: MindFormers' per-rank strategy file name: basename of strategy_ckpt_save_file, ``.ckpt`` -> ``_rank_<r>.ckpt``
MF_STRATEGY_TEMPLATE = "ckpt_strategy_rank_{rank}.ckpt"
CONVERTED_STRATEGY = "strategy.ckpt"  # a conversion's output strategy file
_IN_FLIGHT = (".tmp", ".ckptd-tmp", ".part")
MF2_TRACKER = "latest_checkpointed_iteration.txt"
MF2_COMMON = "common.json"
MF2_METADATA = "metadata.json"
ITERATION_PREFIX = "iteration"  # the catalog prefix of Checkpoint 2.0 steps


@dataclass(frozen=True, slots=True)
class ShardName:
    run: str
    rank: int
    prefix: str  # the step's prefix across ranks: rank tag removed, restart suffix kept
    epoch: int
    step: int  # within the epoch, from the file name
    breakpoint: bool
    format: Literal["ckpt", "safetensors", "json"]
    layout: Layout = NATIVE
    #: which restart wrote it, 0 = the first (the restart suffix ``_k``, see
    #: :func:`~ckptd.runnames.parse_shard_name`); None = not knowable from the name (a breakpoint save)
    incarnation: int | None = None
    #: Checkpoint 2.0 only: which file of the iteration (``rank`` is then its :func:`iteration_slot`)
    role: Role | None = None
    total: int | None = None  # the ``-<n>`` of a model/opt file: how many files that side has

    @property
    def kind(self) -> str:
        return "breakpoint" if self.breakpoint else "trained"


@dataclass(frozen=True, slots=True)
class StrategyName:
    run: str
    #: the rank whose (stage's) layout a per-rank file holds; None for a run-wide file
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class MetaName:
    """MindFormers' ``meta.json`` of one rank: a hint, never evidence."""

    run: str
    rank: int


@dataclass(frozen=True, slots=True)
class HealthName:
    """MindFormers' ``health_ckpts.json`` of a run."""

    run: str


@dataclass(frozen=True, slots=True)
class TrackerName:
    """MindFormers Checkpoint 2.0's ``latest_checkpointed_iteration.txt`` of a run: a hint."""

    run: str


PathKind = ShardName | StrategyName | MetaName | HealthName | TrackerName | None


def relative_parts(root: str, path: str) -> list[str] | None:
    """Components of ``path`` below ``root``; None if outside it (symlinks are not followed)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel == os.curdir or rel.startswith(os.pardir + os.sep) or rel == os.pardir:
        return None
    return rel.split(os.sep)


def is_in_flight(name: str) -> bool:
    return name.endswith(_IN_FLIGHT)


def unusable_name(name: str, layout: Layout = NATIVE) -> str | None:
    """Why a directory entry that looks like ours cannot be catalogued (None: nothing wrong);
    ``layout``: that of the directory holding it (Checkpoint 2.0 files are named otherwise)."""
    return unusable_file_name(name, iteration=layout == CKPT2)


def iteration_slot(role: Role, index: int = 0) -> int:
    """The shard number of a Checkpoint 2.0 file (the catalog's ``rank`` for these steps)."""
    return {"metadata": 0, "common": 1, "model": 2 + 2 * index, "opt": 3 + 2 * index}[role]


def slot_role(slot: int) -> tuple[Role, int]:
    """Inverse of :func:`iteration_slot`: ``(role, file index)``."""
    if slot < 2:
        return ("metadata" if slot == 0 else "common"), 0
    return ("model" if slot % 2 == 0 else "opt"), (slot - 2) // 2


def parse_iteration_file(run: str, iteration: int, name: str) -> ShardName | None:
    """A file of ``iteration_<it>/`` as a shard of that step, or None when it is not one."""
    if name in (MF2_COMMON, MF2_METADATA):
        role: Role = "common" if name == MF2_COMMON else "metadata"
        return ShardName(run, iteration_slot(role), ITERATION_PREFIX, 0, iteration, False, "json", CKPT2, None, role)
    parsed = read_iteration_file(name)
    if parsed is None:
        return None
    side, index, total = parsed
    return ShardName(run, iteration_slot(side, index), ITERATION_PREFIX, 0, iteration, False, "safetensors",
                     CKPT2, None, side, total)


def classify(root: str, path: str) -> PathKind:
    """What ``path`` is in the checkpoint layout (None = not ours to care about)."""
    parts = relative_parts(root, path)
    if not parts or is_in_flight(parts[-1]) or any(p.startswith(".") for p in parts):
        return None
    run, name = parts[0], parts[-1]
    if len(parts) >= 3 and parts[1] == MF_CHECKPOINT_DIR:
        if len(parts) == 3 and name == MF2_TRACKER:
            return TrackerName(run)
        if len(parts) == 4 and (iteration := parse_iteration_dir(parts[2])) is not None:
            return parse_iteration_file(run, iteration, name)
    rank_dir: str | None = None
    layout = NATIVE
    if len(parts) == 3:
        rank_dir = parts[1]
    elif len(parts) == 4 and parts[1] == MF_CHECKPOINT_DIR:
        rank_dir, layout = parts[2], MINDFORMERS
    if rank_dir is not None and (rank := parse_rank_dir(rank_dir)) is not None:
        if layout == MINDFORMERS and name == MF_META:
            return MetaName(run, rank)
        parsed = parse_shard_name(name, rank)
        if parsed is not None:
            prefix, epoch, step, bp, fmt, incarnation = parsed
            return ShardName(run, rank, prefix, epoch, step, bp, fmt, layout, incarnation)  # type: ignore[arg-type]
        return None
    if len(parts) == 2 and name == MF_HEALTH:
        return HealthName(run)
    return strategy_name(parts)


def strategy_name(parts: list[str]) -> StrategyName | None:
    """``<run>/*strategy*.(ckpt|json)`` or ``<run>/strategy/*.(ckpt|json)``; per-rank files of a
    ``strategy/`` directory (MindFormers) carry their rank."""
    name = parts[-1]
    if not name.endswith((".ckpt", ".json")):
        return None
    if len(parts) == 2:
        return StrategyName(parts[0]) if "strategy" in name else None
    if len(parts) == 3 and parts[1] == STRATEGY_DIR:
        rank = rank_strategy_rank(name)
        if rank is None and is_rank_strategy_name(name):
            return None  # a per-rank name with a rank beyond any job: neither that rank's nor the run's
        return StrategyName(parts[0], rank)
    return None


def is_strategy_name(parts: list[str]) -> bool:
    return strategy_name(parts) is not None


def resolves_inside(root: str, path: str) -> bool:
    """True if ``path``, with every symlink resolved, is still below ``root`` (no escapes)."""
    real_root = os.path.realpath(root).rstrip(os.sep) + os.sep
    return os.path.realpath(path).startswith(real_root)


def sidecar_for(shard_path: str) -> str:
    return shard_path + SIDECAR_SUFFIX


#: a daemon's sharing marker in its root (a dot name: ingest and the watcher never look at it)
NODE_MARKER_PREFIX = ".ckptd-node-"


def node_marker_path(root: str, node: str) -> str:
    """``<root>/.ckptd-node-<node>``: written by every daemon at start; proof that ``node`` watches
    the directory it is found in (other nodes use it to tell a shared root, the launcher to tell
    that ckptd sees the run directory it is about to train in)."""
    return os.path.join(root, NODE_MARKER_PREFIX + node)


def node_of_marker(name: str) -> str | None:
    """The node a marker file name belongs to (None: not a marker)."""
    return name[len(NODE_MARKER_PREFIX):] or None if name.startswith(NODE_MARKER_PREFIX) else None


def run_dir(root: str, run: str) -> str:
    return os.path.join(root, run)


# --- building paths (the writers: ckptd's trainer, fixtures, conversions) ---------------------------


def shard_dir(run_path: str, rank: int, layout: Layout = NATIVE) -> str:
    if layout == MINDFORMERS:
        return os.path.join(run_path, MF_CHECKPOINT_DIR, f"rank_{rank}")
    return os.path.join(run_path, f"rank_{rank}")


def file_prefix(prefix: str, rank: int, layout: Layout = NATIVE, incarnation: int = 0) -> str:
    """The file-name prefix a rank writes: MindFormers tags it ``{P}_rank_{r}[_{k}]``."""
    if layout == MINDFORMERS:
        return f"{prefix}_rank_{rank}" + (f"_{incarnation}" if incarnation else "")
    return prefix


def shard_file_name(prefix: str, rank: int, epoch: int, step: int, layout: Layout = NATIVE, *,
                    incarnation: int = 0, fmt: str = "ckpt") -> str:
    return f"{file_prefix(prefix, rank, layout, incarnation)}-{epoch}_{step}.{fmt}"


def shard_path(run_path: str, rank: int, prefix: str, epoch: int, step: int, layout: Layout = NATIVE, *,
               incarnation: int = 0, fmt: str = "ckpt") -> str:
    name = shard_file_name(prefix, rank, epoch, step, layout, incarnation=incarnation, fmt=fmt)
    return os.path.join(shard_dir(run_path, rank, layout), name)


def rank_strategy_path(run_path: str, rank: int) -> str:
    """MindFormers' per-rank strategy file (``strategy/ckpt_strategy_rank_<r>.ckpt``)."""
    return os.path.join(run_path, STRATEGY_DIR, MF_STRATEGY_TEMPLATE.format(rank=rank))


def rank_strategies_dir(run_path: str) -> str:
    """The directory of per-rank strategy files; ckptd catalogues their merge under this path."""
    return os.path.join(run_path, STRATEGY_DIR)


def converted_strategy_path(out_dir: str) -> str:
    """The strategy file of a converted copy (``<out>/strategy.ckpt``, next to its ``rank_<r>/``)."""
    return os.path.join(out_dir, CONVERTED_STRATEGY)


def meta_path(run_path: str, rank: int) -> str:
    return os.path.join(shard_dir(run_path, rank, MINDFORMERS), MF_META)


def health_path(run_path: str) -> str:
    return os.path.join(run_path, MF_HEALTH)


def iteration_dir(run_path: str, iteration: int) -> str:
    return os.path.join(run_path, MF_CHECKPOINT_DIR, f"iteration_{iteration:08d}")


def iteration_file_name(prefix: str | None, role: Role, index: int = 0, total: int = 1) -> str:
    """``get_checkpoint_name``'s ``{P}-{model|opt}-{i:07d}-{n:07d}.safetensors`` (no ``P-`` without a prefix)."""
    if role in ("common", "metadata"):
        return MF2_COMMON if role == "common" else MF2_METADATA
    return (f"{prefix}-" if prefix else "") + f"{role}-{index:07d}-{total:07d}.safetensors"


def tracker_path(run_path: str) -> str:
    return os.path.join(run_path, MF_CHECKPOINT_DIR, MF2_TRACKER)


# --- listing ------------------------------------------------------------------------------------


def detect_layout(run_path: str) -> Layout:
    """A run is MindFormers-shaped when ``checkpoint/rank_<r>/`` exists, Checkpoint 2.0 when
    ``checkpoint/iteration_<it>/`` does (decided per run; legacy wins if a run holds both)."""
    if _scan_rank_dirs(os.path.join(run_path, MF_CHECKPOINT_DIR))[0]:
        return MINDFORMERS
    return CKPT2 if iteration_dirs(run_path) else NATIVE


def is_iteration_dir(root: str, path: str) -> bool:
    """``<root>/<run>/checkpoint/iteration_<it>`` (by name; the caller checks what it is on disk)."""
    parts = relative_parts(root, path)
    return parts is not None and len(parts) == 3 and parts[1] == MF_CHECKPOINT_DIR \
        and parse_iteration_dir(parts[2]) is not None


def iteration_dirs(run_path: str) -> dict[int, str]:
    """``checkpoint/iteration_<it>/`` directories of a run (real directories, no symlinks)."""
    return _scan_iteration_dirs(run_path)[0]


def _scan_iteration_dirs(run_path: str) -> tuple[dict[int, str], dict[str, str]]:
    """``checkpoint/iteration_<it>/`` directories of a run, and those named so whose number is
    beyond any step (path -> why: skipped)."""
    found: dict[int, str] = {}
    refused: dict[str, str] = {}
    try:
        with os.scandir(os.path.join(run_path, MF_CHECKPOINT_DIR)) as it:
            for entry in it:
                iteration = parse_iteration_dir(entry.name)
                if not entry.is_dir(follow_symlinks=False):
                    continue
                if iteration is not None:
                    found[iteration] = entry.path
                elif (why := unusable_dir(entry.name)) is not None:
                    refused[entry.path] = why
    except (FileNotFoundError, NotADirectoryError):
        pass
    return found, refused


@dataclass(frozen=True, slots=True)
class RunDirs:
    """What a rescan lists of one run (:func:`shard_dirs`)."""

    shard_dirs: list[tuple[str, Layout]]  # every directory that holds shards, with its layout
    linked: dict[int, str]  # ``rank_<r>`` entries that are symlinks: never followed
    refused: dict[str, str]  # directories named like rank/iteration ones, beyond any job: path -> why


def shard_dirs(run_path: str) -> RunDirs:
    """The directories of a run a rescan lists (:class:`RunDirs`); one layout detection and one
    listing."""
    layout = detect_layout(run_path)
    if layout == CKPT2:
        found, refused = _scan_iteration_dirs(run_path)
        return RunDirs([(d, CKPT2) for _, d in sorted(found.items())], {}, refused)
    dirs, links, refused = _scan_rank_dirs(_rank_base(run_path, layout))
    return RunDirs([(d, layout) for d in dirs.values()], links, refused)


def rank_dirs(run_path: str, layout: Layout | None = None) -> dict[int, str]:
    """``rank_<r>`` shard directories of a run in its layout (real directories, no symlinks;
    none for Checkpoint 2.0, whose shards live in iteration directories)."""
    return _scan_rank_dirs(_rank_base(run_path, layout))[0]


def _rank_base(run_path: str, layout: Layout | None) -> str | None:
    """Where a run's ``rank_<r>`` directories are (None: Checkpoint 2.0 has none)."""
    layout = layout or detect_layout(run_path)
    if layout == CKPT2:
        return None
    return os.path.join(run_path, MF_CHECKPOINT_DIR) if layout == MINDFORMERS else run_path


def _scan_rank_dirs(base: str | None) -> tuple[dict[int, str], dict[int, str], dict[str, str]]:
    """``rank_<r>`` entries of ``base``: (real directories, symlinks, directories named so whose
    rank is beyond any job: path -> why)."""
    dirs: dict[int, str] = {}
    links: dict[int, str] = {}
    refused: dict[str, str] = {}
    if base is None:
        return dirs, links, refused
    try:
        with os.scandir(base) as it:
            for entry in it:
                rank = parse_rank_dir(entry.name)
                if rank is None:
                    if entry.is_dir(follow_symlinks=False) and (why := unusable_dir(entry.name)) is not None:
                        refused[entry.path] = why
                elif entry.is_symlink():
                    links[rank] = entry.path
                elif entry.is_dir(follow_symlinks=False):
                    dirs[rank] = entry.path
    except (FileNotFoundError, NotADirectoryError):
        pass
    return dirs, links, refused
