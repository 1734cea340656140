"""Start-up time of ``ckptd`` commands (issue 24): the whole process, against ``python -c pass``.

Each command runs ``--repeat`` times, interleaved with the baseline in one loop (so machine load
hits both alike); the table prints medians and each command's excess over the baseline. The
target is <= 0.15 s for ``--help``, ``ls``, ``resume --json`` and ``inspect``.

    python bench/cli_startup.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptd.format.checkpoint import write_checkpoint  # noqa: E402

TARGET = 0.15


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        (root / "run1" / "rank_0").mkdir(parents=True)
        shard = root / "run1" / "rank_0" / "net-1_10.ckpt"
        write_checkpoint(shard, [("w", np.arange(1024, dtype=np.float32))], crc=True)
        db = f"sqlite:///{tmp}/catalog.db"
        env = dict(os.environ, CKPTD_DB=db, CKPTD_ROOT=str(root))
        subprocess.run([sys.executable, "-m", "ckptd", "db", "upgrade"], env=env, check=True, capture_output=True)
        py = [sys.executable]
        commands = {
            "python -c pass": py + ["-c", "pass"],
            "ckptd --help": py + ["-m", "ckptd", "--help"],
            "ckptd ls": py + ["-m", "ckptd", "ls"],
            "ckptd resume --json": py + ["-m", "ckptd", "resume", "--run", "run1", "--json"],
            "ckptd inspect": py + ["-m", "ckptd", "inspect", str(shard)],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for name, argv in commands.items():  # warm the page cache and .pyc files
            timed(argv, env)
        for _ in range(args.repeat):
            for name, argv in commands.items():
                times[name].append(timed(argv, env))
    base = statistics.median(times["python -c pass"])
    print(f"load average {os.getloadavg()[0]:.2f}; {args.repeat} runs each, medians")
    print("| command | median | over `python -c pass` | target <= 0.15 s |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        verdict = "-" if name == "python -c pass" else ("met" if med <= TARGET else "**missed**")
        print(f"| `{name}` | {med:.3f} s | +{med - base:.3f} s | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
