"""Flash checkpoints under the launcher (issue 22): a 4-rank tp=2 x dp=2 job under msrun snapshots
every step; one rank is SIGKILLed from outside at a random step; the launcher asks the real
``ckptd serve``, which answers from the nodes' memory, and the job ends bitwise equal to an
uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import trainer_helpers as th
from tests.api_helpers import serve_process, stop_process
from ckptd.storage import memslot
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


def _kill_at(run_dir, victim: int, attempt: int, step: int) -> dict:
    beat = wait_for(lambda: (b := _beat(run_dir, victim)) and b.get("attempt") == attempt and b["step"] >= step and b,
                    timeout=300, interval=0.01, what=f"rank {victim} of attempt {attempt} at step {step}")
    os.kill(beat["pid"], signal.SIGKILL)  # from outside, wherever the rank is in its step
    return beat


@pytest.mark.slow
def test_killed_ranks_resume_from_memory_then_from_the_persisted_file_when_memory_is_gone(tmp_path, ref):
    """Attempt 0: a random rank is killed at a random step; the restart loads every rank from
    memory (RPO <= 1). Attempt 1: another rank is killed at step 11 and the node's shared memory is
    wiped right after (a node reboot): the restart loads step 10, which the daemon persisted from
    memory as files. The job ends bitwise equal to an uninterrupted run."""
    root, shm = tmp_path / "root", tmp_path / "shm"
    root.mkdir()
    log = tmp_path / "serve.log"
    server, client = serve_process(root, migrated_sqlite(tmp_path / "c.db"), log, "--persist-every", "5",
                                   "--memory-root", str(shm))
    run_dir = root / "flash4"
    rng = random.Random(os.environ.get("PYTEST_XDIST_WORKER", "") + str(time.time_ns()))
    first, second, at = rng.randrange(4), rng.randrange(4), rng.randrange(6, 9)
    cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(run_dir), "--tp", "2", "--dp", "2",
           "--ckptd-url", str(client.base_url), "--backoff", "0.2", "--", *th.TINY, *STEPS,
           "--snapshot-every", "1", "--memory-root", str(shm)]
    launcher = subprocess.Popen(cmd, cwd=th.REPO, env=th.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        beat = _kill_at(run_dir, first, 0, at)
        _kill_at(run_dir, second, 1, 11)
        shutil.rmtree(shm / memslot.run_key(str(run_dir)))
        _, err = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        stop_process(server)
    lines = "\n".join(l for l in err.splitlines() if l.startswith("launch:"))
    assert launcher.returncode == 0, lines + err[-3000:]
    assert f"attempt=0 event=rank_failed rank={first}" in lines and f"attempt=1 event=rank_failed rank={second}" in lines
    from_memory = json.loads((run_dir / "launcher" / "resume_1.json").read_text())
    # RPO <= 1: the victim was in step beat["step"]; that step's predecessor may still have been
    # committing when it died
    assert from_memory["tier"] == "memory" and beat["step"] - 2 <= from_memory["step"] <= beat["step"], from_memory
    assert sorted(s["rank"] for s in from_memory["shards"]) == [0, 1, 2, 3]
    assert all(s["path"].startswith(str(shm)) for s in from_memory["shards"])
    from_files = json.loads((run_dir / "launcher" / "resume_2.json").read_text())
    # step 10's files if the daemon had persisted every rank of it before the wipe, else step 5's
    assert from_files["tier"] == "file" and from_files["step"] in (5, 10), from_files
    assert [s["path"] for s in from_files["shards"]] == [th.shard(run_dir, r, from_files["step"]) for r in range(4)]
    for attempt, answer in ((1, from_memory), (2, from_files)):
        assert f"attempt={attempt} event=resume step={answer['step']}" in lines, lines
    for r in range(4):
        assert th.read(th.shard(run_dir, r, 12)) == th.read(th.shard(ref, r, 12)), f"rank {r}"
