"""What every run layout shares: the :class:`RunLayout` protocol, the names a path can have, and
the path rules no layout owns alone (strategy files, rank directories, in-flight writes).

A layout is one directory shape of a run (``native``, ``mindformers``, ``mindformers2``: the
values of the catalog's ``runs.layout``). Each lives in its own module (:mod:`.native`,
:mod:`.mindformers`, :mod:`.ckpt2`) as one immutable :class:`RunLayout` object, and the registry
(:mod:`ckptd.runlayout`) asks them in turn. The service never compares layout names: it asks the
object (``by_name(run.layout).iterations``) and dispatches on the answer, so a new layout is a
module and a registry entry, not a branch in every caller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ckptd.runnames import (
    Role,
    is_rank_strategy_name,
    parse_rank_dir,
    parse_shard_name,
    rank_strategy_rank,
    unusable_dir,
    unusable_file_name,
)

#: the layout of a run whose directory has no other layout's shape (the fallback; also a
#: :class:`ShardName`'s default)
DEFAULT_LAYOUT = "native"
SIDECAR_SUFFIX = ".done"
#: MindFormers' directory of saves, in both of its layouts (``rank_<r>/`` or ``iteration_<it>/`` below)
MF_CHECKPOINT_DIR = "checkpoint"
STRATEGY_DIR = "strategy"
#: MindFormers' per-rank strategy file name: basename of strategy_ckpt_save_file, ``.ckpt`` -> ``_rank_<r>.ckpt``
MF_STRATEGY_TEMPLATE = "ckpt_strategy_rank_{rank}.ckpt"
CONVERTED_STRATEGY = "strategy.ckpt"  # a conversion's output strategy file
IN_FLIGHT_SUFFIXES = (".tmp", ".ckptd-tmp", ".part")


@dataclass(frozen=True, slots=True)
class ShardName:
    run: str
    rank: int
    prefix: str  # the step's prefix across ranks: rank tag removed, restart suffix kept
    epoch: int
    step: int  # within the epoch, from the file name
    breakpoint: bool
    format: Literal["ckpt", "safetensors", "json"]
    #: the name of the layout whose shape the path has (:attr:`RunLayout.name`, ``runs.layout``)
    layout: str = DEFAULT_LAYOUT
    #: which restart wrote it, 0 = the first (the restart suffix ``_k``, see
    #: :func:`~ckptd.runnames.parse_shard_name`); None = not knowable from the name (a breakpoint save)
    incarnation: int | None = None
    #: Checkpoint 2.0 only: which file of the iteration (``rank`` is then its ``iteration_slot``)
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


class NotMine:
    """What :meth:`RunLayout.classify` returns for a path outside its shape (None means: of its
    shape, but nothing ckptd cares about; the registry then stops asking)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_MINE"


NOT_MINE = NotMine()


@dataclass(frozen=True, slots=True)
class RunDirs:
    """What a rescan lists of one run (``runlayout.shard_dirs``)."""

    layout: RunLayout  # the run's, as detected: every directory below holds shards of this layout
    shard_dirs: list[str]
    linked: dict[int, str]  # ``rank_<r>`` entries that are symlinks: never followed
    refused: dict[str, str]  # directories named like rank/iteration ones, beyond any job: path -> why


@dataclass(frozen=True, slots=True)
class RunLayout:
    """One directory shape of a run: the protocol each layout module implements by subclassing
    (with ``__slots__ = ()``, so instances stay immutable and hashable) and instantiating once.

    The flags are what the service asks instead of comparing names; the methods are the layout's
    path rules. Only :meth:`detects`, :meth:`rank_dirs` and :meth:`list_dirs` list a directory."""

    #: the catalog's ``runs.layout`` value, and :attr:`ShardName.layout` (never renamed: no migration)
    name: str
    #: a run of no other shape has this one; any other layout found later replaces it in the catalog
    fallback: bool = False
    #: a step may be whole without every rank's own file (``states.allows_subset``)
    allows_subset: bool = False
    #: a step is one directory whose files are its shards: judged by ``service/iteration.py`` as a
    #: whole (no strategy file, no per-rank facts), its layout read from its own ``metadata.json``
    iterations: bool = False
    #: ``health_ckpts.json`` records of the run apply to its steps as they arrive
    health_records: bool = False
    #: the resume answer carries MindFormers' own resume arguments over ``rank_<r>/`` directories
    mindformers_resume: bool = False
    #: the run has a tracker file whose state the resume answer reports (no catalog write announces
    #: a change to it, so such an answer is never cached)
    has_tracker: bool = False

    def detects(self, run_path: str) -> bool:
        """True if the run directory has this layout's shape (lists it)."""
        raise NotImplementedError

    def classify(self, parts: list[str]) -> PathKind | NotMine:
        """What the path ``parts`` (below the root, no dot or in-flight names) is in this layout;
        :data:`NOT_MINE` when the path is outside its shape."""
        raise NotImplementedError

    def rank_base(self, run_path: str) -> str | None:
        """The directory of the run's ``rank_<r>/`` directories (None: the layout has none)."""
        raise NotImplementedError

    def shard_dir(self, run_path: str, rank: int) -> str:
        """Where ``rank`` writes its shards (the writers: ckptd's trainer, fixtures)."""
        base = self.rank_base(run_path)
        if base is None:
            raise ValueError(f"a {self.name} run has no rank directories")
        return os.path.join(base, f"rank_{rank}")

    def file_prefix(self, prefix: str, rank: int, incarnation: int = 0) -> str:
        """The file-name prefix a rank writes (plain MindSpore: the prefix as given; restarts are
        told apart by the suffix MindSpore itself appends)."""
        return prefix

    def unusable_name(self, name: str) -> str | None:
        """Why a directory entry of this layout's shard directories that looks like ours cannot be
        catalogued (None: nothing wrong)."""
        return unusable_file_name(name, iteration=self.iterations)

    def rank_dirs(self, run_path: str) -> dict[int, str]:
        """``rank_<r>`` shard directories of the run (real directories, no symlinks)."""
        return scan_rank_dirs(self.rank_base(run_path))[0]

    def list_dirs(self, run_path: str) -> RunDirs:
        """The directories a rescan lists of a run of this layout (one listing)."""
        dirs, links, refused = scan_rank_dirs(self.rank_base(run_path))
        return RunDirs(self, list(dirs.values()), links, refused)

    def is_step_dir(self, parts: list[str]) -> bool:
        """Whether the directory ``parts`` is one step's own, removed with it once empty (rank
        directories outlive every step)."""
        return False

    def whole_step_dir(self, files: list[ShardName]) -> bool:
        """For :attr:`iterations` layouts: whether a step directory's (committed, trained) files
        are a whole save by their names alone (the launcher's fresh-start guard)."""
        return False


def rank_shard(layout: str, run: str, rank: int, name: str) -> ShardName | None:
    """The file ``name`` of ``rank_<rank>/`` as a shard (None: not a shard name)."""
    parsed = parse_shard_name(name, rank)
    if parsed is None:
        return None
    prefix, epoch, step, bp, fmt, incarnation = parsed
    return ShardName(run, rank, prefix, epoch, step, bp, fmt, layout, incarnation)  # type: ignore[arg-type]


def scan_rank_dirs(base: str | None) -> tuple[dict[int, str], dict[int, str], dict[str, str]]:
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


def relative_parts(root: str, path: str) -> list[str] | None:
    """Components of ``path`` below ``root``; None if outside it (symlinks are not followed)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel == os.curdir or rel.startswith(os.pardir + os.sep) or rel == os.pardir:
        return None
    return rel.split(os.sep)


def is_in_flight(name: str) -> bool:
    return name.endswith(IN_FLIGHT_SUFFIXES)


# --- strategy files: the same rules in every layout ---------------------------------------------


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


def rank_strategy_path(run_path: str, rank: int) -> str:
    """MindFormers' per-rank strategy file (``strategy/ckpt_strategy_rank_<r>.ckpt``)."""
    return os.path.join(run_path, STRATEGY_DIR, MF_STRATEGY_TEMPLATE.format(rank=rank))


def rank_strategies_dir(run_path: str) -> str:
    """The directory of per-rank strategy files; ckptd catalogues their merge under this path."""
    return os.path.join(run_path, STRATEGY_DIR)


def converted_strategy_path(out_dir: str) -> str:
    """The strategy file of a converted copy (``<out>/strategy.ckpt``, next to its ``rank_<r>/``)."""
    return os.path.join(out_dir, CONVERTED_STRATEGY)
