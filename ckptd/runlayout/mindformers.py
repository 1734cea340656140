"""MindFormers 2.x legacy ``CheckpointMonitor`` (``<run>`` = its ``output_dir``)::

    <root>/<run>/checkpoint/rank_<r>/<name>               a shard
    <root>/<run>/checkpoint/rank_<r>/meta.json            MindFormers' own resume hint (lags, can lie)
    <root>/<run>/strategy/<base>_rank_<r>.ckpt            one strategy file per rank (a stage's, under pp)
    <root>/<run>/strategy/merged_ckpt_strategy*.ckpt      merge_pipeline_strategys' output (sometimes)
    <root>/<run>/health_ckpts.json                        health records (is_health 1 = abnormal)
    <root>/<run>/checkpoint_network|checkpoint_trainable/ network-only copies: not training checkpoints

MindFormers tags every rank's files ``{P}_rank_{r}`` (the tag is dropped from the step's prefix,
see :func:`ckptd.runnames.parse_shard_name`). Its jobs save with ``remove_redundancy`` and
MindIO's dying-gasp saves write only some replicas, so a step may be whole as a subset of ranks.
"""

from __future__ import annotations

import os

from ckptd.runlayout.base import (
    MF_CHECKPOINT_DIR,
    NOT_MINE,
    HealthName,
    MetaName,
    NotMine,
    PathKind,
    RunLayout,
    rank_shard,
    scan_rank_dirs,
)
from ckptd.runnames import parse_rank_dir

MF_META = "meta.json"
MF_HEALTH = "health_ckpts.json"


class MindFormers(RunLayout):
    __slots__ = ()

    def detects(self, run_path: str) -> bool:
        """``checkpoint/rank_<r>/`` exists (a real directory): asked before Checkpoint 2.0, so a
        run holding both is this one."""
        return bool(scan_rank_dirs(self.rank_base(run_path))[0])

    def classify(self, parts: list[str]) -> PathKind | NotMine:
        if len(parts) == 2 and parts[1] == MF_HEALTH:
            return HealthName(parts[0])
        if len(parts) != 4 or parts[1] != MF_CHECKPOINT_DIR or (rank := parse_rank_dir(parts[2])) is None:
            return NOT_MINE
        if parts[3] == MF_META:
            return MetaName(parts[0], rank)
        return rank_shard(self.name, parts[0], rank, parts[3])

    def rank_base(self, run_path: str) -> str:
        return os.path.join(run_path, MF_CHECKPOINT_DIR)

    def file_prefix(self, prefix: str, rank: int, incarnation: int = 0) -> str:
        """MindFormers tags it ``{P}_rank_{r}[_{k}]``."""
        return f"{prefix}_rank_{rank}" + (f"_{incarnation}" if incarnation else "")


LAYOUT = MindFormers("mindformers", allows_subset=True, health_records=True, mindformers_resume=True)


def meta_path(run_path: str, rank: int) -> str:
    return os.path.join(LAYOUT.shard_dir(run_path, rank), MF_META)


def health_path(run_path: str) -> str:
    return os.path.join(run_path, MF_HEALTH)
