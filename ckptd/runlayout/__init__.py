"""Where things live in a checkpoint root — the only package that knows checkpoint path rules.

A run is one directory under the root, in one of three layouts, told apart by the path's shape;
each is an immutable :class:`~ckptd.runlayout.base.RunLayout` object in its own module:

    native        :mod:`.native`       ``<run>/rank_<r>/<name>`` (ckptd's trainer, plain MindSpore jobs)
    mindformers   :mod:`.mindformers`  ``<run>/checkpoint/rank_<r>/<name>`` (MindFormers 2.x legacy)
    mindformers2  :mod:`.ckpt2`        ``<run>/checkpoint/iteration_<it>/`` (MindFormers Checkpoint 2.0)

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
(:mod:`ckptd.runnames`) before it reaches the catalog. A rank tag that names another rank than the
directory is kept in the prefix: the file is misplaced and must not pass for that rank's shard.

This module is the registry: :func:`detect` asks each layout in turn (:data:`LAYOUTS`: MindFormers
legacy first, so a run holding both MindFormers shapes is legacy; native last, the fallback) and
:func:`by_name` maps a catalog value back to its object. The functions taking a layout *name*
below are the path API callers had before layouts were objects. The pure functions classify and
build paths; only :func:`detect` / :func:`rank_dirs` / :func:`shard_dirs` list a directory.
"""

from __future__ import annotations

import os
from typing import Literal, TypeGuard

from ckptd.runlayout import ckpt2, mindformers, native
from ckptd.runlayout.base import (  # noqa: F401  (re-exported: callers use runlayout)
    CONVERTED_STRATEGY,
    MF_CHECKPOINT_DIR,
    MF_STRATEGY_TEMPLATE,
    NOT_MINE,
    SIDECAR_SUFFIX,
    STRATEGY_DIR,
    HealthName,
    MetaName,
    PathKind,
    RunDirs,
    RunLayout,
    ShardName,
    StrategyName,
    TrackerName,
    converted_strategy_path,
    is_in_flight,
    rank_strategies_dir,
    rank_strategy_path,
    relative_parts,
    strategy_name,
)
from ckptd.runlayout.ckpt2 import (  # noqa: F401
    ITERATION_PREFIX,
    MF2_COMMON,
    MF2_METADATA,
    MF2_TRACKER,
    iteration_dir,
    iteration_file_name,
    iteration_slot,
    parse_iteration_file,
    slot_role,
    tracker_path,
)
from ckptd.runlayout.mindformers import MF_HEALTH, MF_META, health_path, meta_path  # noqa: F401

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

#: every layout, in the order detection and classification ask them (native, the fallback, last)
LAYOUTS: tuple[RunLayout, ...] = (mindformers.LAYOUT, ckpt2.LAYOUT, native.LAYOUT)
_BY_NAME = {layout.name: layout for layout in LAYOUTS}

Layout = Literal["native", "mindformers", "mindformers2"]  # a layout's name: runs.layout, ShardName.layout
NATIVE: Layout = "native"
MINDFORMERS: Layout = "mindformers"
CKPT2: Layout = "mindformers2"
assert tuple(_BY_NAME) == (MINDFORMERS, CKPT2, NATIVE)  # the names are the catalog's: never renamed


def by_name(name: str | None) -> RunLayout:
    """The layout a catalog value names (None, a run catalogued before layouts existed: native)."""
    if name is None:
        return native.LAYOUT
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown run layout {name!r}: one of {', '.join(_BY_NAME)}") from None


def known(name: object) -> TypeGuard[str]:
    """Whether ``name`` is a layout's name (for values read from outside: an answer's JSON)."""
    return isinstance(name, str) and name in _BY_NAME


def detect(run_path: str) -> RunLayout:
    """The layout of a run directory: the first of :data:`LAYOUTS` whose shape it has."""
    return next(layout for layout in LAYOUTS if layout.detects(run_path))


def detect_layout(run_path: str) -> Layout:
    """The name of :func:`detect`'s layout."""
    return detect(run_path).name  # type: ignore[return-value]


def run_layout_after(stored: str | None, seen: str) -> str:
    """The layout a run's catalog row holds once a shard of layout ``seen`` was found in it: a run
    holds one layout, and a MindFormers tree is never taken for native (the fallback gives way)."""
    return seen if by_name(stored).fallback else stored  # type: ignore[return-value]


def _as_layout(layout: str | RunLayout | None) -> RunLayout:
    return layout if isinstance(layout, RunLayout) else by_name(layout)


def classify(root: str, path: str) -> PathKind:
    """What ``path`` is in the checkpoint layout (None = not ours to care about)."""
    parts = relative_parts(root, path)
    if not parts or is_in_flight(parts[-1]) or any(p.startswith(".") for p in parts):
        return None
    for layout in LAYOUTS:  # their shapes are disjoint: the first that claims the path decides
        kind = layout.classify(parts)
        if kind is not NOT_MINE:
            return kind  # type: ignore[return-value]
    return strategy_name(parts)


def unusable_name(name: str, layout: str | RunLayout = NATIVE) -> str | None:
    """Why a directory entry that looks like ours cannot be catalogued (None: nothing wrong);
    ``layout``: that of the directory holding it (Checkpoint 2.0 files are named otherwise)."""
    return _as_layout(layout).unusable_name(name)


def is_step_dir(root: str, path: str) -> bool:
    """Whether ``path`` is a step's own directory in some layout (removed with the step once
    empty; by name: the caller checks what it is on disk)."""
    parts = relative_parts(root, path)
    return parts is not None and any(layout.is_step_dir(parts) for layout in LAYOUTS)


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


def shard_dir(run_path: str, rank: int, layout: str | RunLayout = NATIVE) -> str:
    return _as_layout(layout).shard_dir(run_path, rank)


def file_prefix(prefix: str, rank: int, layout: str | RunLayout = NATIVE, incarnation: int = 0) -> str:
    """The file-name prefix a rank writes: MindFormers tags it ``{P}_rank_{r}[_{k}]``."""
    return _as_layout(layout).file_prefix(prefix, rank, incarnation)


def shard_file_name(prefix: str, rank: int, epoch: int, step: int, layout: str | RunLayout = NATIVE, *,
                    incarnation: int = 0, fmt: str = "ckpt") -> str:
    return f"{file_prefix(prefix, rank, layout, incarnation)}-{epoch}_{step}.{fmt}"


def rank_shard_dirs(run_path: str, rank: int) -> list[str]:
    """Every directory ``rank`` may save into, across the layouts with rank directories (what a
    ``ModelCheckpoint`` of that rank may be pointed at)."""
    return [lay.shard_dir(run_path, rank) for lay in LAYOUTS if lay.rank_base(run_path) is not None]


def shard_path(run_path: str, rank: int, prefix: str, epoch: int, step: int, layout: str | RunLayout = NATIVE, *,
               incarnation: int = 0, fmt: str = "ckpt") -> str:
    name = shard_file_name(prefix, rank, epoch, step, layout, incarnation=incarnation, fmt=fmt)
    return os.path.join(shard_dir(run_path, rank, layout), name)


# --- listing ------------------------------------------------------------------------------------


def shard_dirs(run_path: str) -> RunDirs:
    """The directories of a run a rescan lists (:class:`RunDirs`); one layout detection and one
    listing."""
    return detect(run_path).list_dirs(run_path)


def rank_dirs(run_path: str, layout: str | RunLayout | None = None) -> dict[int, str]:
    """``rank_<r>`` shard directories of a run in its layout (real directories, no symlinks;
    none for Checkpoint 2.0, whose shards live in iteration directories)."""
    return (_as_layout(layout) if layout is not None else detect(run_path)).rank_dirs(run_path)
