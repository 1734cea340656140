"""Elastic restart: a job relaunched in another layout resumes from ckptd's re-sharded copy.

One tp=2 x dp=2 job trains to step 6 under a real ``ckptd serve``; its run directory is also copied,
as saved, under a second run name, so two relaunches start from the same step-6 checkpoint:

* on fewer ranks (tp=2 x dp=1: a node lost): ckptd's oracle answers with a 4-rank step, so the
  launcher asks ckptd to convert it (``POST /conversions``, admin token), waits for the job and
  resumes from the converted copy on 2 ranks;
* at tensor-parallel degree 4 (tp=4 x dp=1, still 4 ranks): the oracle sees the same world size and
  no need to convert, so the launcher compares the answer's strategy hash with its own layout's and
  has ckptd re-shard the step for tp=4.

The global batch is the same in every layout (micro-batch 4 x dp 2 = 8 x 1) and the sampler draws
the global batch, so the losses after each resume are those of an uninterrupted tp=2 x dp=2 run --
up to float rounding (the tp/dp all-reduces sum in another order).
"""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests import trainer_helpers as th
from tests.daemon_helpers import wait_for
from tests.test_e2e import ADMIN, REPORT, Ckptd, ckptd  # noqa: F401 -- the real `ckptd serve` fixture
from trainer.elastic import job_strategy_hash, resume_converted

pytestmark = pytest.mark.slow

COMMON = ["--save-every", "3", "--total-steps", "8"]  # the lr schedule must not depend on --steps
RUN, RUN_TP4 = "elastic", "elastic-tp4"


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


def assert_losses_continue(run_dir: Path, ref: Path) -> None:
    """Steps 1-6 from the 4-rank job, 7-8 from the relaunch: equal to the uninterrupted run."""
    got, want = float_losses(run_dir), float_losses(ref)
    steps = list(range(1, 9))
    assert sorted(got) == steps
    assert np.allclose([got[s] for s in steps], [want[s] for s in steps], rtol=0, atol=1e-5), (got, want)


def worker_log(run_dir: Path) -> str:
    """msrun's per-worker logs of the launcher's first attempt."""
    return "".join(Path(p).read_text(errors="replace")
                   for p in glob.glob(str(run_dir / "launcher" / "attempt_0" / "*.log")))


def convert_jobs(server: Ckptd) -> list[dict]:
    return [j for j in server.get("/v1/jobs", ADMIN).json() if j.get("kind") == "convert"]


@dataclass
class Source:
    ref: Path  # uninterrupted tp=2 x dp=2 to step 8 (outside ckptd's root; its oracle is never asked)
    tp2dp2: str  # the strategy hash the step-6 checkpoint was saved with


@pytest.fixture(scope="module")
def source(ckptd, tmp_path_factory):  # noqa: F811
    """The reference run, and the tp=2 x dp=2 job's step 6 verified under both run names."""
    ref = tmp_path_factory.mktemp("elastic") / "ref"
    rc, log = th.launch(ref, 2, 2, "--steps", "8", "--micro-batch", "4", *COMMON, launch_args=("--fresh",))
    assert rc == 0, log

    run_dir = ckptd.root / RUN
    rc, log = launch(ckptd, run_dir, 2, 2, "--steps", "6", "--micro-batch", "4", *COMMON)
    assert rc == 0, log
    assert "event=fresh_start" in log and "event=finished" in log
    # the same files under a second name, committed the way the trainer commits them (shards, then sidecars)
    copy = ckptd.root / RUN_TP4
    copy.mkdir()
    shutil.copy2(run_dir / "strategy.ckpt", copy / "strategy.ckpt")
    shutil.copy2(run_dir / "metrics.jsonl", copy / "metrics.jsonl")
    for suffix in ("", ".done"):
        for r in range(4):
            (copy / f"rank_{r}").mkdir(exist_ok=True)
            for step in (3, 6):
                shutil.copy2(th.shard(run_dir, r, step) + suffix, th.shard(copy, r, step) + suffix)
    for run in (RUN, RUN_TP4):
        wait_for(lambda run=run: ckptd.step_state(run, 6) == "verified", timeout=60, what=f"{run}: step 6 verified")
    tp2dp2 = job_strategy_hash(2, 2, th.TINY)
    assert ckptd.get(f"/v1/runs/{RUN}/resume").json()["strategy_hash"] == tp2dp2
    return Source(ref, tp2dp2)


@pytest.mark.slow
def test_relaunch_with_fewer_ranks_resumes_from_ckptd_conversion(ckptd, source, monkeypatch):  # noqa: F811
    run_dir = ckptd.root / RUN
    first = ckptd.get(f"/v1/runs/{RUN}/resume?world_size=2").json()
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
    tp2dp1 = job_strategy_hash(2, 1, th.TINY)
    assert answer["strategy_hash"] == tp2dp1 and answer["converted_from_strategy_hash"] == source.tp2dp2
    assert [s["rank"] for s in answer["shards"]] == [0, 1]
    assert all("/converted/" in s["path"] for s in answer["shards"]), answer["shards"]
    jobs = convert_jobs(ckptd)
    assert jobs and jobs[0]["state"] == "done"
    # ... and ckptd now serves that copy to the next 2-rank job without a new conversion
    again = ckptd.get(f"/v1/runs/{RUN}/resume?world_size=2&max_step=6").json()
    assert again["conversion"]["existing"]["shards"] == answer["shards"]
    assert again["conversion"]["existing"]["strategy_hash"] == tp2dp1

    # each rank said it resumed a re-sharded checkpoint (msrun's per-worker logs)
    assert worker_log(run_dir).count("resuming a re-sharded checkpoint saved at tp=2,dp=2") == 2, \
        worker_log(run_dir)[-3000:]
    assert_losses_continue(run_dir, source.ref)

    # --- the same world size in another split: ckptd's copy for 2 ranks is tp=2,dp=1, not tp=1,dp=2 ---
    monkeypatch.setenv("CKPTD_TOKEN", REPORT)
    monkeypatch.setenv("CKPTD_ADMIN_TOKEN", ADMIN)
    # (step 6 as a relaunched launcher saw it, before the 2-rank job saved step 8)
    step6 = _answer_at(ckptd, RUN, 6, 2)
    assert step6.conversion["existing"]["strategy_hash"] == tp2dp1  # ckptd picks its copy by world size only
    events: list[dict] = []
    tp1dp2 = job_strategy_hash(1, 2, th.TINY)
    other = resume_converted(ckptd.url, RUN, 1, 2, tp1dp2, step6, 60, lambda **f: events.append(f))
    assert [e["event"] for e in events] == ["convert_requested", "convert_done"], events
    assert other.body["strategy_hash"] == tp1dp2 and other.step == 6
    assert {s["path"] for s in other.body["shards"]}.isdisjoint(s["path"] for s in answer["shards"])

    # --- refusals ------------------------------------------------------------------------------
    # the trainer's check: a re-sharded copy is this rank's and has exactly this job's shapes
    check_load_shard(Path(answer["shards"][0]["path"]))

    # a conversion ckptd refuses (report-scope token only: 403) -> the launcher gives up, no fresh start
    rc, log = launch_as(ckptd, run_dir, 1, 1, REPORT, "--steps", "8", "--micro-batch", "8", *COMMON)
    assert rc == 2, log
    failed = next(l for l in log.splitlines() if "event=convert_failed" in l)
    assert "to_world=1" in failed and "HTTP 403" in failed and "giving up" in failed
    assert "event=started" not in log and "event=fresh_start" not in log


def test_relaunch_at_tp4_resumes_from_ckptd_conversion(ckptd, source, monkeypatch):  # noqa: F811
    run_dir = ckptd.root / RUN_TP4
    # same world size: ckptd's oracle sees nothing to convert -- only the strategy hash tells the layouts apart
    first = ckptd.get(f"/v1/runs/{RUN_TP4}/resume?world_size=4").json()
    assert first["step"] == 6 and first["world_size"] == 4 and first["conversion"] is None
    tp4 = job_strategy_hash(4, 1, th.TINY)
    assert first["strategy_hash"] == source.tp2dp2 != tp4

    rc, log = launch(ckptd, run_dir, 4, 1, "--steps", "8", "--micro-batch", "8", *COMMON)
    assert rc == 0, log
    lines = log.splitlines()
    req = next(l for l in lines if "event=convert_requested" in l)
    assert "step=6 from_world=4 to_world=4 layout=tp=4,dp=1" in req and "another layout" in req
    assert "event=convert_done" in log
    resume = next(l for l in lines if "event=resume" in l)
    assert "attempt=0 event=resume step=6 from_world=4 to_world=4" in resume
    assert "event=fresh_start" not in log and "event=finished" in log

    answer = json.loads((run_dir / "launcher" / "resume_0.json").read_text())
    assert answer["step"] == 6 and answer["world_size"] == 4
    assert answer["strategy_hash"] == tp4 and answer["converted_from_strategy_hash"] == source.tp2dp2
    assert [s["rank"] for s in answer["shards"]] == [0, 1, 2, 3]
    assert all(f"/{RUN_TP4}/converted/" in s["path"] for s in answer["shards"]), answer["shards"]
    assert worker_log(run_dir).count("resuming a re-sharded checkpoint saved at tp=2,dp=2 (this job: tp=4,dp=1)") \
        == 4, worker_log(run_dir)[-3000:]
    assert_losses_continue(run_dir, source.ref)

    # the tp=4 job's own step 8 carries its strategy: the next tp=4 relaunch resumes it without converting
    wait_for(lambda: ckptd.step_state(RUN_TP4, 8) == "verified", timeout=60, what="step 8 verified")
    newest = ckptd.get(f"/v1/runs/{RUN_TP4}/resume?world_size=4").json()
    assert newest["step"] == 8 and newest["strategy_hash"] == tp4 and newest["conversion"] is None

    # asked again about step 6 at tp=4, the launcher finds the copy it had made (no second conversion)
    monkeypatch.setenv("CKPTD_TOKEN", REPORT)
    monkeypatch.setenv("CKPTD_ADMIN_TOKEN", ADMIN)
    jobs_before = len(convert_jobs(ckptd))
    events: list[dict] = []
    again = resume_converted(ckptd.url, RUN_TP4, 4, 1, tp4, _answer_at(ckptd, RUN_TP4, 6, 4), 60,
                             lambda **f: events.append(f))
    assert [e["event"] for e in events] == ["convert_existing"], events
    assert again.body["shards"] == answer["shards"] and len(convert_jobs(ckptd)) == jobs_before


def _answer_at(server: Ckptd, run: str, step: int, world: int):
    """The oracle's answer as a launcher of ``world`` ranks saw it before anything newer was saved."""
    from trainer.oracle import interpret_answer

    body = server.get(f"/v1/runs/{run}/resume?max_step={step}&world_size={world}").json()
    assert body["step"] == step, body
    return interpret_answer(body, world, "ckptd")


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
