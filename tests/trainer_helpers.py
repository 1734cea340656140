"""Helpers for tests/test_trainer.py: run the real trainer/launcher as subprocesses and read results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from ckptd import runlayout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: tiny model/schedule shared by every multi-step case (the schedule must not depend on layout)
TINY = ["--hidden", "32", "--heads", "4", "--ffn", "64", "--layers", "2", "--seq", "16", "--warmup", "3"]
#: the schedule the launch tests share (saves at steps 3, 6, 8); its uninterrupted tp=2 run is the
#: session fixture ``uninterrupted_tp2`` (tests/conftest.py), computed once for every module using it
SAVES_3_6_8 = ["--steps", "8", "--save-every", "3", "--micro-batch", "4"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO
    e.setdefault("GLOG_v", "3")
    e["OMP_NUM_THREADS"] = "1"
    return e


def train(run_dir, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """One rank, no msrun (``python -m trainer.train``)."""
    proc = subprocess.run([sys.executable, "-m", "trainer.train", "--run-dir", str(run_dir), *TINY, *args],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def scan_cmd(run_dir, world: int) -> str:
    return f"{sys.executable} -m trainer.scan_resume --run-dir {run_dir} --world {world}"


def launch(run_dir, tp: int, dp: int, *train_args: str, launch_args: tuple[str, ...] = (),
           faults: tuple[str, ...] = (), layout: str = runlayout.NATIVE) -> tuple[int, str]:
    """``python -m trainer.launch`` with the scan_resume stand-in oracle; returns (rc, launcher log lines)."""
    cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(run_dir), "--tp", str(tp), "--dp", str(dp),
           "--layout", layout, "--resume-cmd", scan_cmd(run_dir, tp * dp), "--backoff", "0.2", *launch_args]
    for f in faults:
        cmd += ["--fault", f]
    cmd += ["--", *TINY, *train_args]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600, check=False)
    lines = "\n".join(l for l in proc.stderr.splitlines() if l.startswith("launch:"))
    return proc.returncode, lines


def reference_run(tmp_path_factory, tp: int, dp: int, *train_args: str):
    """An uninterrupted run of the same job (``--fresh``: the stand-in oracle is never asked), to
    compare a resumed run with; its run directory."""
    d = tmp_path_factory.mktemp("ref") / "run"
    rc, log = launch(d, tp, dp, *train_args, launch_args=("--fresh",))
    assert rc == 0, log
    return d


def losses(run_dir) -> dict[int, list[tuple[int, str]]]:
    """step -> [(attempt, loss as float.hex)] from rank 0's metrics log."""
    out: dict[int, list[tuple[int, str]]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        for line in fh:
            d = json.loads(line)
            out.setdefault(d["step"], []).append((d["attempt"], d["loss_hex"]))
    return out


def shard(run_dir, rank: int, step: int, prefix: str = "llama", epoch: int = 1, layout: str = runlayout.NATIVE,
          incarnation: int = 0) -> str:
    """A shard's path (``step`` = the step in the file name; in the mindformers layout the step
    within ``epoch``, ``incarnation`` the restart suffix ``_k``)."""
    return runlayout.shard_path(str(run_dir), rank, prefix, epoch, step, layout, incarnation=incarnation)


def read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def load(ms, path: str) -> dict[str, np.ndarray]:
    """Every entry of a checkpoint as numpy (append_dict scalars included)."""
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(path).items()}
