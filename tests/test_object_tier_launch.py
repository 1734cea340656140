"""The object tier under the launcher (issue 23): a real tp=2 MindSpore job run by ``ckptd launch``
under msrun, watched by a real ``ckptd serve --object-store`` against a real SeaweedFS.

While the job trains, the daemon uploads its verified steps and commits them with manifests. Then
the job's machines are lost: the launcher is stopped and the checkpoint root wiped (the catalog is
kept). The same ``ckptd launch`` command, run again, asks ckptd, gets the newest step answered from
the object tier, downloads it into the run directory before the job starts, and the job resumes
from it -- no manual step -- ending bitwise equal to an uninterrupted run (the shared reference
run of tests/conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests import trainer_helpers as th
from tests.api_helpers import free_port, serve_process, stop_process
from tests.daemon_helpers import migrated_sqlite, wait_for

TRAIN_PY = os.path.join(th.REPO, "trainer", "train.py")


def step_tiers(client, run: str) -> dict[int, list[str]]:
    r = client.get(f"/v1/runs/{run}/steps")
    if r.status_code != 200:
        return {}
    body = r.json()
    return {s["step"]: s.get("tiers") or [] for s in (body["steps"] if isinstance(body, dict) else body)}


def up(server, client, log) -> bool:
    if server.poll() is not None:
        raise AssertionError(f"ckptd serve exited {server.returncode}:\n{log.read_text()[-3000:]}")
    try:
        return bool(client.get("/healthz").json().get("first_rescan_done"))
    except httpx.HTTPError:
        return False


def launch_cmd(run_dir: Path, url: str, *train_args: str) -> list[str]:
    """``ckptd launch`` of trainer/train.py under msrun (2 ranks, tp=2); the trainer takes its
    heartbeat directory, attempt, run name, ckptd URL and resume file from the launcher's environment."""
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    return [sys.executable, "-m", "ckptd", "launch", "--run-dir", str(run_dir), "--ckptd-url", url,
            "--backoff", "0.2", "--exit-grace", "1", "--heartbeat-timeout", "600", "--max-restarts", "1", "--",
            msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}",
            f"--log_dir={run_dir / 'msrun_logs'}", "--join=True", TRAIN_PY, "--run-dir", str(run_dir),
            "--tp", "2", "--dp", "1", *th.TINY, *th.SAVES_3_6_8, *train_args]


@pytest.mark.slow
def test_job_resumes_from_the_object_tier_after_its_root_is_wiped(s3, tmp_path, uninterrupted_tp2):
    root = tmp_path / "root"
    root.mkdir()
    s3_env = {**s3.env(), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    log = tmp_path / "serve.log"
    server, client = serve_process(root, migrated_sqlite(tmp_path / "catalog.db"), log,
                                   "--object-store", "s3://ckptd/launch", CKPTD_HEARTBEAT_INTERVAL="1", **s3_env)
    run = "objrun"
    run_dir = root / run
    env = th.env()
    env.update(s3_env)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # msrun's "python"
    launcher = None
    try:
        wait_for(lambda: up(server, client, log), timeout=60, interval=0.2, what="ckptd serve to come up")
        # attempt 0 trains steps 1-6 (saves 3 and 6) and hangs at step 7 (rank 1 sleeps, rank 0 waits
        # for it): the job is alive, and the daemon uploads and commits its steps meanwhile
        launcher = subprocess.Popen(launch_cmd(run_dir, str(client.base_url), "--fault", "hang:1:7"), cwd=th.REPO,
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: (t := step_tiers(client, run)) and all("object" in t.get(s, []) for s in (3, 6)) and t,
                 timeout=400, interval=0.5, what="steps 3 and 6 committed on the object tier while the job runs")
        assert launcher.poll() is None, "the job ended before its steps were on the object tier"
        # rank 1 is still in the job, hung at step 7 (its heartbeat says so once it got there)
        wait_for(lambda: json.loads((run_dir / "heartbeat" / "rank_1.json").read_text())["step"] == 7, timeout=60,
                 interval=0.2, what="rank 1 hung at step 7")
        assert launcher.poll() is None

        # the machines are lost: the job is stopped and the checkpoint root wiped (the catalog stays)
        launcher.send_signal(signal.SIGTERM)  # the launcher stops every rank before it exits
        launcher.communicate(timeout=120)
        for child in root.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        # the daemon keeps running: it sees the files gone, and puts its node marker back (the
        # launcher starts a job only in a directory a daemon it can ask watches)
        wait_for(lambda: any(p.name.startswith(".ckptd-node-") for p in root.iterdir()), timeout=60, interval=0.2,
                 what="the daemon's node marker written again")
        wait_for(lambda: step_tiers(client, run).get(6) == ["object"], timeout=60, interval=0.2,
                 what="step 6 held by the object tier only")

        # the same command again: ckptd answers step 6 from the object tier, the launcher fetches it
        launcher = subprocess.Popen(launch_cmd(run_dir, str(client.base_url)), cwd=th.REPO, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, err = launcher.communicate(timeout=600)
        lines = "\n".join(line for line in err.splitlines() if line.startswith("launch:"))
        assert launcher.returncode == 0, lines + err[-3000:]
        answer = json.loads((run_dir / "launcher" / "resume_0.json").read_text())
        assert answer["tier"] == "object" and answer["step"] == 6, answer
        assert answer["manifest"].endswith(f"/launch/{run}/6/ckptd-manifest.json")
        assert "attempt=0 event=fetched step=6" in lines and "attempt=0 event=resume step=6" in lines, lines
        assert "attempt=0 event=finished" in lines and "rank_failed" not in lines, lines

        # bitwise equal to the uninterrupted run: the losses after the resume and the final shards
        ref_losses, got = th.losses(uninterrupted_tp2), th.losses(run_dir)
        assert sorted(got) == [7, 8]  # metrics.jsonl went with the root: only the resumed steps
        for step, entries in got.items():
            assert {h for _, h in entries} == {ref_losses[step][0][1]}, f"loss of step {step}"
        for r in range(2):
            assert th.read(th.shard(run_dir, r, 8)) == th.read(th.shard(uninterrupted_tp2, r, 8)), f"rank {r}"
            # the fetched step is the one saved before the wipe, byte for byte
            assert th.read(th.shard(run_dir, r, 6)) == th.read(th.shard(uninterrupted_tp2, r, 6)), f"rank {r} step 6"
        # the daemon catalogued the fetched files again: step 6 is whole on both tiers
        wait_for(lambda: step_tiers(client, run).get(6) == ["file", "object"], timeout=60, interval=0.5,
                 what="step 6 verified on files again")
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(60)
            except subprocess.TimeoutExpired:
                launcher.kill()
        stop_process(server)
