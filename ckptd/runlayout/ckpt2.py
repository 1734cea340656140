"""MindFormers Checkpoint 2.0 (``use_legacy_format=False``): one directory per save::

    <root>/<run>/checkpoint/iteration_<8 digits>/<P>-model-<i:07d>-<n:07d>.safetensors   model side, file i of n
    <root>/<run>/checkpoint/iteration_<8 digits>/<P>-opt-<i:07d>-<n:07d>.safetensors     optimizer side
    <root>/<run>/checkpoint/iteration_<8 digits>/common.json    step counters, ckpt_status (1 = abnormal)
    <root>/<run>/checkpoint/iteration_<8 digits>/metadata.json  every tensor's layout and file (world > 1)
    <root>/<run>/checkpoint/latest_checkpointed_iteration.txt   MindFormers' commit record (a hint: torn,
                                                                dangling or stale in the field)

An iteration is one step (prefix ``iteration``, epoch 0, step = the iteration); its files are its
shards, numbered by :func:`iteration_slot` (file numbers are not ranks: a balanced save numbers
only the ranks that got shards, and model and optimizer sides are numbered separately).
MindFormers re-shards such a save into the running layout itself: nothing is converted.
"""

from __future__ import annotations

import os

from ckptd.runlayout.base import (
    MF_CHECKPOINT_DIR,
    NOT_MINE,
    NotMine,
    PathKind,
    RunDirs,
    RunLayout,
    ShardName,
    TrackerName,
)
from ckptd.runnames import Role, parse_iteration_dir, read_iteration_file, unusable_dir

MF2_TRACKER = "latest_checkpointed_iteration.txt"
MF2_COMMON = "common.json"
MF2_METADATA = "metadata.json"
ITERATION_PREFIX = "iteration"  # the catalog prefix of Checkpoint 2.0 steps
NAME = "mindformers2"


class Checkpoint2(RunLayout):
    __slots__ = ()

    def detects(self, run_path: str) -> bool:
        """``checkpoint/iteration_<it>/`` exists (a real directory)."""
        return bool(iteration_dirs(run_path))

    def classify(self, parts: list[str]) -> PathKind | NotMine:
        if len(parts) < 3 or parts[1] != MF_CHECKPOINT_DIR:
            return NOT_MINE
        if len(parts) == 3 and parts[2] == MF2_TRACKER:
            return TrackerName(parts[0])
        if len(parts) == 4 and (iteration := parse_iteration_dir(parts[2])) is not None:
            return parse_iteration_file(parts[0], iteration, parts[3])
        return NOT_MINE

    def rank_base(self, run_path: str) -> None:
        return None  # its shards live in iteration directories

    def list_dirs(self, run_path: str) -> RunDirs:
        found, refused = scan_iteration_dirs(run_path)
        return RunDirs(self, [d for _, d in sorted(found.items())], {}, refused)

    def is_step_dir(self, parts: list[str]) -> bool:
        """An iteration directory is its step: MindFormers' own rotation rmtrees it."""
        return len(parts) == 3 and parts[1] == MF_CHECKPOINT_DIR and parse_iteration_dir(parts[2]) is not None

    def whole_step_dir(self, files: list[ShardName]) -> bool:
        """``common.json`` and every model file its names promise."""
        model = {f.rank for f in files if f.role == "model"}
        totals = {f.total for f in files if f.role == "model"}
        return (any(f.role == "common" for f in files) and len(totals) == 1
                and all(iteration_slot("model", i) in model for i in range(totals.pop() or 0)))


LAYOUT = Checkpoint2(NAME, iterations=True, has_tracker=True)


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
        return ShardName(run, iteration_slot(role), ITERATION_PREFIX, 0, iteration, False, "json", NAME, None, role)
    parsed = read_iteration_file(name)
    if parsed is None:
        return None
    side, index, total = parsed
    return ShardName(run, iteration_slot(side, index), ITERATION_PREFIX, 0, iteration, False, "safetensors",
                     NAME, None, side, total)


def iteration_dir(run_path: str, iteration: int) -> str:
    return os.path.join(run_path, MF_CHECKPOINT_DIR, f"iteration_{iteration:08d}")


def iteration_file_name(prefix: str | None, role: Role, index: int = 0, total: int = 1) -> str:
    """``get_checkpoint_name``'s ``{P}-{model|opt}-{i:07d}-{n:07d}.safetensors`` (no ``P-`` without a prefix)."""
    if role in ("common", "metadata"):
        return MF2_COMMON if role == "common" else MF2_METADATA
    return (f"{prefix}-" if prefix else "") + f"{role}-{index:07d}-{total:07d}.safetensors"


def tracker_path(run_path: str) -> str:
    return os.path.join(run_path, MF_CHECKPOINT_DIR, MF2_TRACKER)


def iteration_dirs(run_path: str) -> dict[int, str]:
    """``checkpoint/iteration_<it>/`` directories of a run (real directories, no symlinks)."""
    return scan_iteration_dirs(run_path)[0]


def scan_iteration_dirs(run_path: str) -> tuple[dict[int, str], dict[str, str]]:
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
