"""Start-up time of ``ckptd`` commands (issue 24): the whole process, against ``python -c pass``.

Each command runs ``--repeat`` times, interleaved with the baseline in one loop (so machine load
hits both alike); the table prints medians and each command's excess over the baseline. The
target is <= 0.15 s for ``--help``, ``ls``, ``resume --json`` and ``inspect``. ``ls`` and ``resume``
are timed three ways: asking a running ``ckptd serve`` named by ``$CKPTD_URL``; with no flag at all
(``$CKPTD_DB`` names the catalog, and the daemon serving it on this machine is found by its
advertisement, ``ckptd.advert``); and opening the catalog directly (``--no-daemon``: SQLAlchemy,
its models and pydantic settings load first).

    python bench/cli_startup.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptd.format.checkpoint import write_checkpoint  # noqa: E402
from ckptd.launcher.supervise import free_port  # noqa: E402

TARGET = 0.15


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def wait_restorable(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ckptd serve exited {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/runs/run1/resume?lease=false", timeout=5) as resp:
                if json.loads(resp.read()).get("step") == 10:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the daemon did not make step 10 restorable in time")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    load_before = loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        (root / "run1" / "rank_0").mkdir(parents=True)
        shard = root / "run1" / "rank_0" / "net-1_10.ckpt"
        write_checkpoint(shard, [("w", np.arange(1024, dtype=np.float32)), ("epoch_num", np.array(1, np.int64)),
                                 ("step_num", np.array(10, np.int64))], crc=True)
        db = f"sqlite:///{tmp}/catalog.db"
        base_env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_URL", "CKPTD_TOKEN")}
        env = dict(base_env, CKPTD_DB=db, CKPTD_ROOT=str(root))
        subprocess.run([sys.executable, "-m", "ckptd", "db", "upgrade"], env=env, check=True, capture_output=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--port", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_restorable(url, server)
            remote = dict(env, CKPTD_URL=url)
            py = [sys.executable]
            commands = {
                "python -c pass": (py + ["-c", "pass"], env),
                "ckptd --help": (py + ["-m", "ckptd", "--help"], env),
                "ckptd ls ($CKPTD_URL)": (py + ["-m", "ckptd", "ls"], remote),
                "ckptd resume --json ($CKPTD_URL)": (py + ["-m", "ckptd", "resume", "--run", "run1", "--json"], remote),
                "ckptd ls (no flag: advertised daemon)": (py + ["-m", "ckptd", "ls"], env),
                "ckptd resume --json (no flag: advertised daemon)": (py + ["-m", "ckptd", "resume", "--run", "run1",
                                                                           "--json"], env),
                "ckptd inspect": (py + ["-m", "ckptd", "inspect", str(shard)], env),
                "ckptd ls --no-daemon (catalog)": (py + ["-m", "ckptd", "ls", "--no-daemon"], env),
                "ckptd resume --json --no-daemon (catalog)": (py + ["-m", "ckptd", "resume", "--run", "run1", "--json",
                                                                    "--no-daemon"], env),
            }
            times: dict[str, list[float]] = {name: [] for name in commands}
            for name, (argv, cmd_env) in commands.items():  # warm the page cache and .pyc files
                timed(argv, cmd_env)
            for _ in range(args.repeat):
                for name, (argv, cmd_env) in commands.items():
                    times[name].append(timed(argv, cmd_env))
        finally:
            server.terminate()
            server.wait(30)
    base = statistics.median(times["python -c pass"])
    print(f"load average (1, 5, 15 min) {load_before} before, {loadavg()} after; {args.repeat} runs each, medians")
    print("| command | median | min | over `python -c pass` | target <= 0.15 s |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        verdict = "-" if name == "python -c pass" else ("met" if med <= TARGET else "**missed**")
        print(f"| `{name}` | {med:.3f} s | {min(ts):.3f} s | +{med - base:.3f} s | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
