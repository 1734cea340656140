"""Flash checkpoints under the launcher (issue 22): a 4-rank tp=2 x dp=2 job under msrun snapshots
every step; one rank is SIGKILLed from outside at a random step; the launcher asks the real
``ckptd serve``, which answers from the nodes' memory, and the job ends bitwise equal to an
uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests import trainer_helpers as th
from tests.api_helpers import serve_process, stop_process
from tests.daemon_helpers import migrated_sqlite, wait_for

STEPS = ["--steps", "12", "--save-every", "100"]  # no file save before the last step


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return th.reference_run(tmp_path_factory, 2, 2, *STEPS)


def _beat(run_dir, rank: int) -> dict | None:
    try:
        with open(os.path.join(run_dir, "heartbeat", f"rank_{rank}.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


@pytest.mark.slow
def test_a_rank_killed_from_outside_resumes_from_memory_bitwise_equal(tmp_path, ref):
    root, shm = tmp_path / "root", tmp_path / "shm"
    root.mkdir()
    log = tmp_path / "serve.log"
    server, client = serve_process(root, migrated_sqlite(tmp_path / "c.db"), log, "--persist-every", "5",
                                   "--memory-root", str(shm))
    run_dir = root / "flash4"
    rng = random.Random(os.environ.get("PYTEST_XDIST_WORKER", "") + str(time.time_ns()))
    victim, at = rng.randrange(4), rng.randrange(6, 10)
    cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(run_dir), "--tp", "2", "--dp", "2",
           "--ckptd-url", str(client.base_url), "--backoff", "0.2", "--", *th.TINY, *STEPS,
           "--snapshot-every", "1", "--memory-root", str(shm)]
    launcher = subprocess.Popen(cmd, cwd=th.REPO, env=th.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        beat = wait_for(lambda: (b := _beat(run_dir, victim)) and b.get("attempt") == 0 and b["step"] >= at and b,
                        timeout=300, interval=0.01, what=f"rank {victim} at step {at}")
        os.kill(beat["pid"], signal.SIGKILL)  # from outside, wherever the rank is in its step
        out, err = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        stop_process(server)
    lines = "\n".join(l for l in err.splitlines() if l.startswith("launch:"))
    assert launcher.returncode == 0, lines + err[-3000:]
    assert f"attempt=0 event=rank_failed rank={victim}" in lines, lines
    answer = json.loads((run_dir / "launcher" / "resume_1.json").read_text())
    # RPO <= 1: the victim was in step beat["step"]; that step's predecessor may still have been
    # committing when it died
    assert answer["tier"] == "memory" and beat["step"] - 2 <= answer["step"] <= beat["step"], (beat, answer)
    assert sorted(s["rank"] for s in answer["shards"]) == [0, 1, 2, 3]
    assert all(s["path"].startswith(str(shm)) for s in answer["shards"])
    assert f"attempt=1 event=resume step={answer['step']}" in lines, lines
    for r in range(4):
        assert th.read(th.shard(run_dir, r, 12)) == th.read(th.shard(ref, r, 12)), f"rank {r}"
