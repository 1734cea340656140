"""Stand-in resume oracle without a server: newest step whose every rank shard is complete and intact.

``python -m trainer.scan_resume --run-dir D --world N`` prints ckptd's resume JSON. A shard counts
only when its ``.done`` sidecar exists and both size and xxh3_128 match (a shard whose writer died
mid-save has no sidecar). Exit 3 with ``{"detail": {"code": "no_restorable_step"}}`` when none.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import xxhash

_NAME = re.compile(r"^(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)\.ckpt$")


def _intact(path: str) -> bool:
    try:
        with open(path + ".done") as fh:
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


def scan(run_dir: str, world: int) -> dict:
    steps: dict[int, dict[int, str]] = {}
    epochs: dict[int, int] = {}
    for rank in range(world):
        d = os.path.join(run_dir, f"rank_{rank}")
        for name in os.listdir(d) if os.path.isdir(d) else ():
            m = _NAME.match(name)
            if m:
                step = int(m.group("step"))
                steps.setdefault(step, {})[rank] = os.path.join(d, name)
                epochs[step] = int(m.group("epoch"))
    skipped = []
    for step in sorted(steps, reverse=True):
        shards = steps[step]
        missing = [r for r in range(world) if r not in shards]
        broken = [r for r, p in shards.items() if not _intact(p)]
        if missing or broken:
            skipped.append({"step": step, "reason": f"incomplete: ranks {sorted(set(missing + broken))} not committed"})
            continue
        strategy = os.path.join(run_dir, "strategy.ckpt")
        return {"run": os.path.basename(os.path.abspath(run_dir)), "step": step, "epoch": epochs[step],
                "global_step": step, "strategy_file": strategy if os.path.exists(strategy) else None,
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
