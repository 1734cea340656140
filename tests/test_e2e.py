"""End to end: a real ``ckptd serve`` process watching a real sharded MindSpore job run by the real launcher.

The server runs as its own process (embedded SQLite catalog, loopback, bearer tokens: the launcher and
trainer get a ``report`` token, the operator an ``admin`` one). The launcher (``python -m
trainer.launch --ckptd-url``) asks ckptd's resume oracle before every attempt, the trainer reports
per-step health to it, and nothing in between is mocked. The job is tp=2 on the tiny model of
tests/test_trainer.py, whose exact-resume claims (bitwise losses and shards) are re-checked here with
ckptd choosing the step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import trainer_helpers as th
from tests.daemon_helpers import query, wait_for
from trainer.oracle import committed_steps, wait_settled
from trainer.scan_resume import shard_intact
from tests.api_helpers import free_port, stop_process

STEPS = th.SAVES_3_6_8  # saves at steps 3, 6, 8; the shared reference run (conftest) is of these
REPORT, ADMIN = "e2e-report-token", "e2e-admin-token"


@dataclass
class Ckptd:
    url: str
    root: Path
    db: str
    log: Path
    proc: subprocess.Popen

    def client(self, token: str | None = REPORT) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"} if token else {},
                            timeout=30)

    def get(self, path: str, token: str | None = REPORT):
        with self.client(token) as c:
            return c.get(path)

    def step_state(self, run: str, step: int) -> str | None:
        r = self.get(f"/v1/runs/{run}/steps/{step}")
        return r.json()["state"] if r.status_code == 200 else None


@pytest.fixture(scope="module")
def ckptd(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckptd")
    root = base / "root"
    root.mkdir()
    db = f"sqlite:///{base / 'catalog.db'}"
    tokens = base / "tokens"
    tokens.write_text(f"report {REPORT}\nadmin {ADMIN}\n")
    subprocess.run([sys.executable, "-m", "ckptd", "db", "upgrade", "--db", db], cwd=th.REPO, env=th.env(),
                   check=True, capture_output=True)
    port = free_port()
    log = base / "ckptd.log"
    # tokens through the environment: `serve --token-file F` crashes in this ckptd (the flag bypasses
    # settings validation and stays a str); CKPTD_TOKEN_FILE is validated into a Path
    env = dict(th.env(), CKPTD_TOKEN_FILE=str(tokens))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--port", str(port),
                                 "--db", db], cwd=th.REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Ckptd(f"http://127.0.0.1:{port}", root, db, log, proc)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"ckptd serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return bool(server.get("/healthz", None).json().get("first_rescan_done"))
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=60, interval=0.2, what="ckptd serve to come up")
    yield server
    stop_process(proc)


@pytest.fixture(scope="module")
def ref(uninterrupted_tp2):
    """The same job without any failure (outside ckptd's root; the stand-in oracle is never asked)."""
    return uninterrupted_tp2


def launch(server: Ckptd, run_dir: Path, *train_args: str, faults: tuple[str, ...] = (),
           launch_args: tuple[str, ...] = ()) -> tuple[int, str]:
    """The real launcher, tp=2, asking the real ckptd; returns (rc, its ``launch:`` lines)."""
    cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(run_dir), "--tp", "2", "--dp", "1",
           "--ckptd-url", server.url, "--backoff", "0.2", *launch_args]
    for f in faults:
        cmd += ["--fault", f]
    cmd += ["--", *th.TINY, *train_args]
    env = th.env()
    env["CKPTD_TOKEN"] = REPORT  # report scope: enough for the oracle (read) and for health reports
    proc = subprocess.run(cmd, cwd=th.REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    return proc.returncode, "\n".join(l for l in proc.stderr.splitlines() if l.startswith("launch:"))


def assert_same_losses_and_shards(ref_dir: Path, got_dir: Path, final: int = 8) -> None:
    """Every step's loss (every attempt that computed it) and the final shards equal the reference, bitwise."""
    ref, got = th.losses(ref_dir), th.losses(got_dir)
    assert sorted(got) == list(range(1, final + 1))
    for step, entries in got.items():
        assert {h for _, h in entries} == {ref[step][0][1]}, f"loss of step {step} differs from the uninterrupted run"
    for r in range(2):
        assert th.read(th.shard(got_dir, r, final)) == th.read(th.shard(ref_dir, r, final)), f"rank {r} step {final}"


def flip_byte(path: str) -> None:
    """Bit rot: one bit in the middle of the file (a tensor payload), in place, size unchanged."""
    size = os.path.getsize(path)
    os.chmod(path, 0o600)  # MindSpore leaves shards 0400
    with open(path, "r+b") as fh:
        fh.seek(size // 2)
        b = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([b[0] ^ 0x10]))


# --------------------------------------------------------------------------------------------------


def test_killed_rank_resumes_from_ckptd_verified_step_exactly(ckptd, ref):
    run = "fault-tp2"
    run_dir = ckptd.root / run
    rc, log = launch(ckptd, run_dir, *STEPS, faults=("kill:1:8",))
    assert rc == 0, log

    # the launcher's decisions, one line each
    assert "attempt=0 event=fresh_start step=0" in log  # ckptd: run not catalogued yet / nothing restorable
    assert "attempt=0 event=rank_failed rank=1 step=8" in log and "SIGKILL" in log
    assert "attempt=1 event=catalog_settled" in log and "6=verified" in log
    assert "attempt=1 event=resume step=6" in log
    assert "attempt=1 event=finished" in log

    # what ckptd answered: the newest save whose every shard is on disk, committed (sidecar) and intact
    answer = json.loads((run_dir / "launcher" / "resume_1.json").read_text())
    assert answer["run"] == run and answer["step"] == answer["global_step"] == 6 and answer["epoch"] == 1
    assert [(e["rank"], e["path"]) for e in answer["shards"]] == [(r, th.shard(run_dir, r, 6)) for r in range(2)]
    assert answer["strategy_file"] == str(run_dir / "strategy.ckpt")
    assert answer["skipped"] == []  # step 8 was never reached by the killed attempt
    assert all(shard_intact(s["path"]) for s in answer["shards"])  # size + xxh3 match the trainer's own sidecar
    # ... and ckptd's catalog shows that step (and every other save) verified, shard by shard
    steps = {s["step"]: s for s in ckptd.get(f"/v1/runs/{run}/steps").json()}
    assert steps[6]["state"] == "verified" and steps[6]["restorable"]
    wait_for(lambda: ckptd.step_state(run, 8) == "verified", timeout=60, what="step 8 verified")
    shards = ckptd.get(f"/v1/runs/{run}/steps/6/shards").json()
    assert [(s["rank"], s["state"], s["crc"]) for s in shards] == [(0, "verified", "valid"), (1, "verified", "valid")]

    # the loss curve after the resume is the uninterrupted run's, bit for bit, and so are the final shards
    assert_same_losses_and_shards(ref, run_dir)
    losses = th.losses(run_dir)
    # step 7 trained again after the resume (attempt 0's line for it is there unless rank 0 was
    # stopped between rank 1's death and writing it)
    assert [a for a, _ in losses[7]] in ([0, 1], [1])

    # the trainer's health reports reached ckptd: one row per step, the final attempt's loss exactly
    rows = query(ckptd.db, "SELECT h.step, h.loss, h.grad_norm, h.overflow FROM step_health h "
                           "JOIN runs r ON r.id = h.run_id WHERE r.name = :run ORDER BY h.step", run=run)
    metrics = {}
    with open(run_dir / "metrics.jsonl") as fh:
        for line in fh:
            d = json.loads(line)
            metrics[d["step"]] = d  # the last attempt wins, as in ckptd (upsert per step)
    # every step of the final attempt; attempt 0's reports are best effort (one still queued when
    # that attempt was stopped is lost with it), so of steps 1-6 the ones that arrived are checked
    assert {7, 8} <= {r[0] for r in rows} <= set(range(1, 9)), rows
    for step, loss, grad_norm, overflow in rows:
        assert (loss, grad_norm, bool(overflow)) == (metrics[step]["loss"], metrics[step]["grad_norm"], False), step

    # and they matter to the oracle: a NaN loss reported at step 7 rules out the step-8 checkpoint
    with ckptd.client() as c:
        assert c.get(f"/v1/runs/{run}/resume").json()["step"] == 8
        assert c.post(f"/v1/runs/{run}/health", json={"step": 7, "loss": "NaN", "grad_norm": 1.0,
                                                       "overflow": True}).status_code == 204
        after = c.get(f"/v1/runs/{run}/resume").json()
    assert after["step"] == 6 and [s["step"] for s in after["skipped"]] == [8]
    assert "nan" in after["skipped"][0]["reason"].lower()


@pytest.mark.slow
def test_corrupt_newest_step_is_skipped_on_relaunch(ckptd, ref):
    run = "bitrot-tp2"
    run_dir = ckptd.root / run
    # the job dies at step 8 and, this time, so does its launcher (no restarts left)
    rc, log = launch(ckptd, run_dir, *STEPS, faults=("kill:0:8",), launch_args=("--max-restarts", "0"))
    assert rc == 1 and "event=rank_failed rank=0 step=8" in log and "event=giving_up" in log, log
    wait_for(lambda: ckptd.step_state(run, 6) == "verified", timeout=60, what="step 6 verified")
    assert ckptd.get(f"/v1/runs/{run}/resume").json()["step"] == 6

    # while nobody trains, one bit of rank 1's newest shard rots; an operator re-verifies the run
    flip_byte(th.shard(run_dir, 1, 6))
    with ckptd.client(REPORT) as c:
        denied = c.post(f"/v1/runs/{run}/verify", json={})
    assert denied.status_code == 403 and denied.json()["detail"]["code"] == "forbidden"
    with ckptd.client(ADMIN) as c:
        started = c.post(f"/v1/runs/{run}/verify", json={})
        assert started.status_code == 202, started.text
        job_id = started.json()["id"]
        job = wait_for(lambda: (j := c.get(f"/v1/jobs/{job_id}").json())["state"] in ("done", "failed") and j,
                       timeout=60, what="re-verification job")
    assert job["state"] == "done" and job["result"]["shards"]["corrupt"] == 1, job
    corrupt = ckptd.get(f"/v1/runs/{run}/steps").json()
    assert [(s["step"], s["state"]) for s in corrupt] == [(6, "corrupt"), (3, "verified")]
    assert corrupt[0]["reason"].startswith("rank 1:")

    # the relaunched job asks ckptd first and resumes from the older, intact step, saying why
    rc, log = launch(ckptd, run_dir, *STEPS, launch_args=("--max-restarts", "0"))
    assert rc == 0, log
    assert 'event=catalog_settled' in log and "6=corrupt, 3=verified" in log
    resume_line = next(l for l in log.splitlines() if "event=resume" in l)
    assert "attempt=0 event=resume step=3" in resume_line and "skipped 6 (corrupt: rank 1:" in resume_line
    answer = json.loads((run_dir / "launcher" / "resume_0.json").read_text())
    assert answer["step"] == 3 and answer["skipped"][0]["step"] == 6
    assert answer["skipped"][0]["reason"].startswith("corrupt: rank 1:")
    assert_same_losses_and_shards(ref, run_dir)

    # the resumed job saved step 6 again (bitwise what the rotten file once was): ckptd re-verifies it
    wait_for(lambda: ckptd.step_state(run, 6) == "verified" and ckptd.step_state(run, 8) == "verified",
             timeout=60, what="steps 6 and 8 verified after the relaunch")
    assert th.read(th.shard(run_dir, 1, 6)) == th.read(th.shard(ref, 1, 6))


def test_launcher_waits_for_ckptd_verdict_on_the_newest_committed_save(ckptd, ref, monkeypatch):
    """The launcher's settle wait (what keeps a restart from resuming older than it has to)."""
    monkeypatch.setenv("CKPTD_TOKEN", REPORT)
    assert committed_steps(str(ref), 2) == [(1, 8), (1, 6), (1, 3)]  # on every rank: shard + .done sidecar (or MindSpore's 0400)
    # a run ckptd has nothing of (saves outside its root): nothing to judge -- the fresh-start guard,
    # not the barrier, refuses to start such a run from step 0
    res = wait_settled(ckptd.url, "never-seen", timeout=30)
    assert res.settled and res.steps == [], res
    # the same save arriving under the root, the way the trainer commits it (shards, then sidecars):
    # the wait ends on ckptd's verdict, and the oracle then answers with that step
    run_dir = ckptd.root / "copied"
    for r in range(2):
        (run_dir / f"rank_{r}").mkdir(parents=True)
    shutil.copy(ref / "strategy.ckpt", run_dir / "strategy.ckpt")
    for suffix in ("", ".done"):
        for r in range(2):
            shutil.copy(th.shard(ref, r, 8) + suffix, th.shard(run_dir, r, 8) + suffix)
    res = wait_settled(ckptd.url, "copied", timeout=60)
    assert res.settled and res.steps == [("8", "verified")], res
    assert ckptd.get("/v1/runs/copied/resume").json()["step"] == 8
