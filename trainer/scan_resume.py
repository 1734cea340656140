"""Stand-in resume oracle without a server: newest step whose every rank shard is complete and intact.

``python -m trainer.scan_resume --run-dir D --world N`` prints ckptd's resume JSON. A shard counts
only when its ``.done`` sidecar exists and both size and xxh3_128 match (a shard whose writer died
mid-save has no sidecar). Exit 3 with ``{"detail": {"code": "no_restorable_step"}}`` when none.

Either layout, detected per run (:func:`ckptd.runlayout.detect_layout`): ``rank_<r>/`` or
MindFormers' ``checkpoint/rank_<r>/``. A step is identified as ckptd does -- (prefix without the rank
tag, with MindFormers' restart suffix ``_k``; epoch; step in the file name) -- so the saves of two
restarts never mix; of two complete saves of one (epoch, step) the later restart's wins.
``step``/``global_step`` in the answer are the training step the shards hold (their ``step_num``;
the file name's step when a shard cannot be read without a key), ``name_step`` the file name's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import xxhash

from ckptd import runlayout


def shard_intact(path: str) -> bool:
    try:
        with open(path + runlayout.SIDECAR_SUFFIX) as fh:
            hint = json.load(fh)
        if hint.get("size") != os.path.getsize(path):
            return False
        h = xxhash.xxh3_128()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        return h.hexdigest() == hint.get("xxh3_128")
    except (OSError, ValueError, AttributeError):
        return False


def _content_step(path: str) -> int | None:
    """The global step a shard holds (``step_num``), None when unreadable without a key."""
    from ckptd.errors import CkptdError
    from ckptd.format.checkpoint import open_checkpoint

    try:
        with open_checkpoint(path, key=None) as ck:
            return int(ck.value("step_num"))
    except (CkptdError, OSError, KeyError, TypeError, ValueError):
        return None


def saves_on_disk(run_dir: str, world: int) -> dict[tuple[str, int, int], dict[int, str]]:
    """The trainer's ``.ckpt`` saves in the run directory: (prefix, epoch, step) -> rank -> path,
    newest first (of two restarts' saves of one (epoch, step), the later restart's first)."""
    dirs = runlayout.rank_dirs(run_dir)
    saves: dict[tuple[str, int, int], dict[int, str]] = {}
    restart: dict[tuple[str, int, int], int] = {}
    for rank in range(world):
        try:
            names = os.listdir(dirs[rank]) if rank in dirs else []
        except OSError:  # a rank directory gone or unreadable: that rank saved nothing we can use
            names = []
        d = dirs.get(rank, "")
        for name in names:
            parsed = runlayout.parse_shard_name(name, rank)
            if parsed is None or parsed[3] or parsed[4] != "ckpt":  # breakpoint / safetensors: not ours
                continue
            key = (parsed[0], parsed[1], parsed[2])
            saves.setdefault(key, {})[rank] = os.path.join(d, name)
            restart[key] = parsed[5] or 0
    return {k: saves[k] for k in sorted(saves, key=lambda k: (k[1], k[2], restart[k]), reverse=True)}


def committed_saves(run_dir: str, world: int) -> list[tuple[str, int, int]]:
    """(prefix, epoch, step) of every save all ranks committed (``.done`` sidecar, or MindSpore's
    final ``chmod 0400``), newest first: what the tests and the chaos bench compare ckptd with."""
    return [key for key, shards in saves_on_disk(run_dir, world).items()
            if len(shards) == world and all(_committed(p) for p in shards.values())]


def committed_steps(run_dir: str, world: int) -> list[tuple[int, int]]:
    """(epoch, step) of :func:`committed_saves`, once each even when several restarts saved it."""
    return list(dict.fromkeys((epoch, step) for _, epoch, step in committed_saves(run_dir, world)))


def _committed(path: str) -> bool:
    try:
        return os.path.exists(path + runlayout.SIDECAR_SUFFIX) or not os.stat(path).st_mode & 0o222
    except OSError:
        return False


def scan(run_dir: str, world: int) -> dict:
    from trainer.checkpoint import strategy_path  # numpy and the strategy writer: only the scan needs them

    layout = runlayout.detect_layout(run_dir)
    saves = saves_on_disk(run_dir, world)
    # MindFormers: the directory of per-rank files (what ckptd catalogues their merge under)
    strategy = runlayout.rank_strategies_dir(run_dir) if layout == runlayout.MINDFORMERS else strategy_path(run_dir, 0)
    skipped = []
    for key in saves:
        prefix, epoch, name_step = key
        shards = saves[key]
        missing = [r for r in range(world) if r not in shards]
        broken = [r for r, p in shards.items() if not shard_intact(p)]
        if missing or broken:
            bad = sorted(set(missing + broken))
            skipped.append({"step": name_step, "reason": f"incomplete: ranks {bad} not committed"})
            continue
        step = _content_step(shards[0])
        step = name_step if step is None else step
        return {"run": os.path.basename(os.path.abspath(run_dir)), "step": step, "epoch": epoch,
                "global_step": step, "name_step": name_step, "prefix": prefix, "world_size": world,
                "layout": layout, "strategy_file": strategy if os.path.exists(strategy) else None,
                "shards": [{"rank": r, "path": shards[r]} for r in range(world)], "skipped": skipped}
    return {"detail": {"code": "no_restorable_step", "skipped": skipped}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainer.scan_resume", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--world", type=int, required=True)
    args = p.parse_args(argv)
    answer = scan(args.run_dir, args.world)
    print(json.dumps(answer))
    return 3 if "detail" in answer else 0


if __name__ == "__main__":
    sys.exit(main())
