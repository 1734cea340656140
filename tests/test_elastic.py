"""Elastic restart: a job relaunched with a different world size resumes from ckptd's re-sharded copy.

A tp=2 x dp=2 job trains to step 6 under a real ``ckptd serve``; the launcher is then started again on
the same run as tp=2 x dp=1. ckptd's oracle answers with a 4-rank step, so the launcher asks ckptd to
convert it (``POST /conversions``, admin token), waits for the job, and resumes from the converted
copy on 2 ranks. The global batch is the same (micro-batch 8 x dp 1 = 4 x 2) and the sampler draws
the global batch, so the losses after the resume are those of an uninterrupted tp=2 x dp=2 run --
up to float rounding (the dp all-reduce sums in another order).
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import trainer_helpers as th
from tests.daemon_helpers import wait_for
from tests.test_e2e import ADMIN, REPORT, Ckptd, ckptd  # noqa: F401 -- the real `ckptd serve` fixture

pytestmark = pytest.mark.slow

COMMON = ["--save-every", "3", "--total-steps", "8"]  # the lr schedule must not depend on --steps


def launch(server: Ckptd, run_dir: Path, tp: int, dp: int, *train_args: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(run_dir), "--tp", str(tp), "--dp", str(dp),
           "--ckptd-url", server.url, "--backoff", "0.2", "--max-restarts", "0", "--convert-timeout", "120",
           "--", *th.TINY, *train_args]
    env = th.env()
    env["CKPTD_TOKEN"] = REPORT
    env["CKPTD_ADMIN_TOKEN"] = ADMIN  # conversions need admin scope
    proc = subprocess.run(cmd, cwd=th.REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    return proc.returncode, "\n".join(l for l in proc.stderr.splitlines() if l.startswith("launch:"))


def float_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    with open(run_dir / "metrics.jsonl") as fh:
        for line in fh:
            d = json.loads(line)
            out[d["step"]] = d["loss"]  # the last write of a step wins
    return out


def test_relaunch_with_fewer_ranks_resumes_from_ckptd_conversion(ckptd, tmp_path):  # noqa: F811
    # reference: uninterrupted tp=2 x dp=2 to step 8 (outside ckptd's root; its oracle is never asked)
    ref = tmp_path / "ref"
    rc, log = th.launch(ref, 2, 2, "--steps", "8", "--micro-batch", "4", *COMMON, launch_args=("--fresh",))
    assert rc == 0, log

    run = "elastic"
    run_dir = ckptd.root / run
    rc, log = launch(ckptd, run_dir, 2, 2, "--steps", "6", "--micro-batch", "4", *COMMON)
    assert rc == 0, log
    assert "event=fresh_start" in log and "event=finished" in log
    wait_for(lambda: ckptd.step_state(run, 6) == "verified", timeout=60, what="step 6 verified")
    first = ckptd.get(f"/v1/runs/{run}/resume?world_size=2").json()
    assert first["step"] == 6 and first["world_size"] == 4
    assert first["conversion"]["needed"] and first["conversion"]["existing"] is None

    # relaunch on half the ranks, same global batch
    rc, log = launch(ckptd, run_dir, 2, 1, "--steps", "8", "--micro-batch", "8", *COMMON)
    assert rc == 0, log
    lines = log.splitlines()
    req = next(l for l in lines if "event=convert_requested" in l)
    assert "step=6 from_world=4 to_world=2 layout=tp=2,dp=1" in req
    done = next(l for l in lines if "event=convert_done" in l)
    assert "step=6 from_world=4 to_world=2" in done
    resume = next(l for l in lines if "event=resume" in l)
    assert "attempt=0 event=resume step=6 from_world=4 to_world=2" in resume
    assert "event=fresh_start" not in log and "event=finished" in log

    # the launcher handed the trainer ckptd's converted copy, one shard per new rank
    answer = json.loads((run_dir / "launcher" / "resume_0.json").read_text())
    assert answer["step"] == 6 and answer["world_size"] == 2 and answer["converted_from_world_size"] == 4
    assert [s["rank"] for s in answer["shards"]] == [0, 1]
    assert all("/converted/" in s["path"] for s in answer["shards"]), answer["shards"]
    jobs = [j for j in ckptd.get("/v1/jobs", ADMIN).json() if j.get("kind") == "convert"]
    assert jobs and jobs[-1]["state"] == "done"
    # ... and ckptd now serves that copy to the next 2-rank job without a new conversion
    again = ckptd.get(f"/v1/runs/{run}/resume?world_size=2&max_step=6").json()
    assert again["conversion"]["existing"]["shards"] == answer["shards"]

    # each rank said it resumed a re-sharded checkpoint (msrun's per-worker logs)
    worker_logs = "".join(Path(p).read_text(errors="replace")
                          for p in glob.glob(str(run_dir / "launcher" / "attempt_0" / "*.log")))
    assert worker_logs.count("resuming a re-sharded checkpoint saved at tp=2,dp=2") == 2, worker_logs[-3000:]

    # losses: steps 1-6 from the 4-rank job, 7-8 from the 2-rank job, equal to the uninterrupted run
    got, want = float_losses(run_dir), float_losses(ref)
    assert sorted(got) == list(range(1, 9))
    steps = list(range(1, 9))
    assert np.allclose([got[s] for s in steps], [want[s] for s in steps], rtol=0, atol=1e-5), (got, want)

    # --- refusals ------------------------------------------------------------------------------
    # the trainer's check: a re-sharded copy is this rank's and has exactly this job's shapes
    check_load_shard(Path(answer["shards"][0]["path"]))

    # a conversion ckptd refuses (report-scope token only: 403) -> the launcher gives up, no fresh start
    rc, log = launch_as(ckptd, run_dir, 1, 1, REPORT, "--steps", "8", "--micro-batch", "8", *COMMON)
    assert rc == 2, log
    failed = next(l for l in log.splitlines() if "event=convert_failed" in l)
    assert "to_world=1" in failed and "HTTP 403" in failed and "giving up" in failed
    assert "event=started" not in log and "event=fresh_start" not in log


def launch_as(server: Ckptd, run_dir: Path, tp: int, dp: int, admin: str, *train_args: str) -> tuple[int, str]:
    """The launcher with ``admin`` as its conversion token (only up to the oracle: settle skipped)."""
    cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(run_dir), "--tp", str(tp), "--dp", str(dp),
           "--ckptd-url", server.url, "--max-restarts", "0", "--settle-timeout", "0", "--", *th.TINY, *train_args]
    env = th.env()
    env["CKPTD_TOKEN"] = REPORT
    env["CKPTD_ADMIN_TOKEN"] = admin
    proc = subprocess.run(cmd, cwd=th.REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, "\n".join(l for l in proc.stderr.splitlines() if l.startswith("launch:"))


def check_load_shard(converted_rank0: Path) -> None:
    import mindspore as ms

    from trainer.checkpoint import load_shard
    from trainer.topology import Topology

    saved = th.load(ms, str(converted_rank0))
    from trainer.data import STATE_KEYS

    meta = {"step_num", "epoch_num", "rank_id", "tp", "dp", *STATE_KEYS}
    names = [n for n in saved if n not in meta]

    def targets(bad: str | None = None) -> dict[str, ms.Parameter]:
        out = {}
        for n in names:
            shape = saved[n].shape if n != bad else (saved[n].shape[0] + 1, *saved[n].shape[1:])
            out[n] = ms.Parameter(ms.Tensor(np.zeros(shape, saved[n].dtype)), name=n)
        return out

    assert int(saved["tp"]) == 2 and int(saved["dp"]) == 2 and int(saved["rank_id"]) == 0
    ok = targets()
    restored = load_shard(str(converted_rank0), Topology(2, 1, 0), ok, None)
    assert restored.step == 6
    for n in names:
        assert np.array_equal(ok[n].asnumpy(), saved[n]), n
    with pytest.raises(RuntimeError, match="belongs to rank 0"):
        load_shard(str(converted_rank0), Topology(2, 1, 1), targets(), None)
    bad = next(n for n in names if saved[n].ndim >= 1)
    with pytest.raises(RuntimeError, match="not re-sharded for tp=2,dp=1"):
        load_shard(str(converted_rank0), Topology(2, 1, 0), targets(bad), None)
