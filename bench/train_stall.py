"""Benchmark: training stall caused by checkpointing, and the cost of a rank's death.

1. Stall: one rank trains ``--steps`` steps checkpointing *every* step with ``async_save=True``,
   with ``async_save=False``, and without checkpoints; per-step wall time (end-to-end, so it includes
   the ``save_checkpoint`` call and any GIL/IO interference of MindSpore's write thread).
2. Recovery: ``python -m trainer.launch`` runs tp=2 on 2 ranks, rank 1 is SIGKILLed at step
   ``--kill-step``; we measure death -> launcher decision (detection), death -> first completed
   training step after the restart (detection + resume lookup + msrun restart + restore), and the
   steps of work lost (done before death but after the checkpoint it resumed from).

Prints markdown tables. Run: ``.venv/bin/python bench/train_stall.py`` (about 2-3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env.setdefault("GLOG_v", "3")
    return env


def _metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def stall(args, model: list[str]) -> list[tuple[str, float, float, float]]:
    rows = []
    for label, extra in (("no checkpoint", ["--save-every", "0"]), ("async_save=True", ["--save-every", "1"]),
                         ("async_save=False", ["--save-every", "1", "--sync-save"])):
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([sys.executable, "-m", "trainer.train", "--run-dir", d, "--steps", str(args.steps),
                            *model, *extra], cwd=REPO, env=_env(), check=True, capture_output=True)
            m = _metrics(d)[2:]  # skip warm-up steps
            walls = [b["time"] - a["time"] for a, b in itertools.pairwise(m)]
            size = sum(os.path.getsize(os.path.join(d, "rank_0", f)) for f in os.listdir(os.path.join(d, "rank_0"))
                       if f.endswith(".ckpt")) / max(1, len([f for f in os.listdir(os.path.join(d, "rank_0"))
                                                             if f.endswith(".ckpt")])) if extra[1] != "0" else 0
            rows.append((label, statistics.median(walls), statistics.median(x["save_s"] for x in m), size / 1e6))
    return rows


def recovery(args) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", d, "--tp", "2", "--dp", "1",
               "--resume-cmd", f"{sys.executable} -m trainer.scan_resume --run-dir {d} --world 2",
               "--backoff", str(args.backoff), "--fault", f"kill:1:{args.kill_step}", "--",
               "--steps", str(args.kill_step + 4), "--save-every", str(args.save_every)]
        subprocess.run(cmd, cwd=REPO, env=_env(), check=True, capture_output=True)
        with open(os.path.join(d, "heartbeat", "fault_rank_1.json")) as fh:
            death = json.load(fh)["time"]
        events: dict[tuple[str, str], tuple[float, str]] = {}
        with open(os.path.join(d, "launcher.log")) as fh:
            for line in fh:
                t, rest = line.split(" ", 1)
                fields = dict(f.split("=", 1) for f in rest.split() if "=" in f)
                events.setdefault((fields.get("attempt", ""), fields.get("event", "")), (float(t), rest))
        resumed_step = int(events[("1", "resume")][1].split("step=")[1].split()[0])
        decisions = {"rank_failed": events[("0", "rank_failed")][0], "started": events[("1", "started")][0]}
        again = min(x["time"] for x in _metrics(d) if x["attempt"] == 1)
        return {"detect_s": decisions["rank_failed"] - death, "restart_s": decisions["started"] - death,
                "training_again_s": again - death, "steps_lost": (args.kill_step - 1) - resumed_step,
                "resumed_from": resumed_step}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kill-step", type=int, default=9)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--backoff", type=float, default=1.0)
    args = p.parse_args()
    model = ["--hidden", str(args.hidden), "--ffn", str(args.ffn), "--layers", str(args.layers), "--heads", "4"]
    rows = stall(args, model)
    base = rows[0][1]
    print(f"### Checkpoint stall (1 rank, hidden={args.hidden} ffn={args.ffn} layers={args.layers}, save every step)\n")
    print("| mode | median step wall (s) | in save_checkpoint (s) | shard (MB) | stall vs no checkpoint |")
    print("|---|---|---|---|---|")
    for label, wall, save_s, mb in rows:
        print(f"| {label} | {wall:.3f} | {save_s:.4f} | {mb:.1f} | {wall / base:.2f}x |")
    a, s = rows[1][1] - base, rows[2][1] - base
    print(f"\nasync/sync stall ratio: {a / s if s > 0 else float('nan'):.2f} (extra s/step: async {a:.3f}, sync {s:.3f})\n")
    r = recovery(args)
    print(f"### Rank death -> training again (tp=2 on 2 ranks, kill rank 1 at step {args.kill_step}, "
          f"save every {args.save_every}, launcher back-off {args.backoff}s)\n")
    print("| death->detected (s) | death->msrun restarted (s) | death->first step trained (s) | resumed from | steps lost |")
    print("|---|---|---|---|---|")
    print(f"| {r['detect_s']:.2f} | {r['restart_s']:.2f} | {r['training_again_s']:.2f} | {r['resumed_from']} | "
          f"{r['steps_lost']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
