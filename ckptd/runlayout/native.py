"""The native layout: ckptd's trainer and plain MindSpore jobs (the fallback of detection)::

    <root>/<run>/rank_<r>/<name>                          a shard
    <root>/<run>/[strategy/]*strategy*.(ckpt|json)        the parallel strategy file

Every rank restores from its own file, so a step needs every rank's (no subset steps).
"""

from __future__ import annotations

from ckptd.runlayout.base import DEFAULT_LAYOUT, NOT_MINE, NotMine, PathKind, RunLayout, rank_shard
from ckptd.runnames import parse_rank_dir


class Native(RunLayout):
    __slots__ = ()

    def detects(self, run_path: str) -> bool:
        return True  # asked last: a run of no other shape is native, even an empty one

    def classify(self, parts: list[str]) -> PathKind | NotMine:
        if len(parts) != 3 or (rank := parse_rank_dir(parts[1])) is None:
            return NOT_MINE
        return rank_shard(self.name, parts[0], rank, parts[2])

    def rank_base(self, run_path: str) -> str:
        return run_path


LAYOUT = Native(DEFAULT_LAYOUT, fallback=True)
