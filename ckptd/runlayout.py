"""Where things live in a checkpoint root — the only module that parses checkpoint paths.

    <root>/<run>/rank_<r>/<prefix>-<epoch>_<step>[_breakpoint].(ckpt|safetensors)   a shard
    <root>/<run>/rank_<r>/<shard file>.done                                          trainer's commit hint (JSON)
    <root>/<run>/[strategy/]*strategy*.(ckpt|json)                                   parallel strategy file(s)
    ... .tmp / .ckptd-tmp                                                             in-flight writes: never shards

MindSpore's ``ModelCheckpoint`` names files ``{prefix}-{epoch}_{step}.ckpt`` where ``step`` counts
within the epoch, and renames a clashing prefix to ``{prefix}_{n}``; breakpoint saves
(``exception_save``) end in ``_breakpoint``. The pure functions here classify a path; they never
touch the disk.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

SHARD_SUFFIXES = (".ckpt", ".safetensors")
SIDECAR_SUFFIX = ".done"
_RANK_DIR = re.compile(r"^rank_(\d+)$")
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)(?P<bp>_breakpoint)?\.(?P<ext>ckpt|safetensors)$")
_IN_FLIGHT = (".tmp", ".ckptd-tmp", ".part")


@dataclass(frozen=True, slots=True)
class ShardName:
    run: str
    rank: int
    prefix: str
    epoch: int
    step: int
    breakpoint: bool
    format: Literal["ckpt", "safetensors"]

    @property
    def kind(self) -> str:
        return "breakpoint" if self.breakpoint else "trained"


@dataclass(frozen=True, slots=True)
class StrategyName:
    run: str


PathKind = ShardName | StrategyName | None


def relative_parts(root: str, path: str) -> list[str] | None:
    """Components of ``path`` below ``root``; None if outside it (symlinks are not followed)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel == os.curdir or rel.startswith(os.pardir + os.sep) or rel == os.pardir:
        return None
    return rel.split(os.sep)


def is_in_flight(name: str) -> bool:
    return name.endswith(_IN_FLIGHT)


def classify(root: str, path: str) -> PathKind:
    """What ``path`` is in the checkpoint layout (None = not ours to care about)."""
    parts = relative_parts(root, path)
    if not parts or is_in_flight(parts[-1]) or any(p.startswith(".") for p in parts):
        return None
    name = parts[-1]
    if len(parts) == 3:
        rank_match = _RANK_DIR.match(parts[1])
        shard = _SHARD_NAME.match(name)
        if rank_match and shard:
            return ShardName(
                run=parts[0],
                rank=int(rank_match.group(1)),
                prefix=shard.group("prefix"),
                epoch=int(shard.group("epoch")),
                step=int(shard.group("step")),
                breakpoint=bool(shard.group("bp")),
                format="ckpt" if shard.group("ext") == "ckpt" else "safetensors",
            )
    if is_strategy_name(parts):
        return StrategyName(run=parts[0])
    return None


def is_strategy_name(parts: list[str]) -> bool:
    """``<run>/*strategy*.(ckpt|json)`` or ``<run>/strategy/*.(ckpt|json)``."""
    name = parts[-1]
    if not name.endswith((".ckpt", ".json")):
        return False
    if len(parts) == 2:
        return "strategy" in name
    return len(parts) == 3 and parts[1] == "strategy"


def resolves_inside(root: str, path: str, *, real_root: str | None = None) -> bool:
    """True if ``path``, with every symlink resolved, is still below ``root`` (no escapes).
    ``real_root``: ``os.path.realpath(root)`` if the caller already has it (the ingest hot path)."""
    real_root = (real_root or os.path.realpath(root)).rstrip(os.sep) + os.sep
    return os.path.realpath(path).startswith(real_root)


def sidecar_for(shard_path: str) -> str:
    return shard_path + SIDECAR_SUFFIX


def run_dir(root: str, run: str) -> str:
    return os.path.join(root, run)


def rank_dirs(run_path: str) -> dict[int, str]:
    """``rank_<r>`` directories of a run (real directories only, no symlinks)."""
    found: dict[int, str] = {}
    try:
        with os.scandir(run_path) as it:
            for entry in it:
                m = _RANK_DIR.match(entry.name)
                if m and entry.is_dir(follow_symlinks=False):
                    found[int(m.group(1))] = entry.path
    except FileNotFoundError:
        pass
    return found
