"""Flash checkpoints end to end (issue 22): the real trainer snapshots every step into a memory
root, a real ``ckptd serve`` catalogues the slots, persists every 5th step as a file, and answers
a resume from memory; the resumed job ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from tests.api_helpers import resume_of, serve_process, stop_process
from tests.daemon_helpers import migrated_sqlite, wait_for
from tests.trainer_helpers import load, read, shard, train

STEPS = 14
KILL_AT = 13  # the rank dies at the start of step 13: steps 1-12 are done
PERSIST = 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, saving files every 5 steps with MindSpore's own save_checkpoint."""
    d = tmp_path_factory.mktemp("ref") / "run1"
    train(d, "--steps", str(STEPS), "--save-every", str(PERSIST), "--sync-save")
    return d


@pytest.fixture
def served(tmp_path):
    root, shm = tmp_path / "root", tmp_path / "shm"
    root.mkdir()
    log = tmp_path / "serve.log"
    proc, client = serve_process(root, migrated_sqlite(tmp_path / "c.db"), log, "--persist-every", str(PERSIST),
                                 "--memory-root", str(shm))
    try:
        wait_for(lambda: resume_of(proc, client, log, "none") is None and _up(client), timeout=60, what="serve up")
        yield root, shm, client, proc, log
    finally:
        stop_process(proc)


def _up(client) -> bool:
    try:
        return client.get("/healthz").status_code in (200, 503)
    except httpx.TransportError:
        return False


def _killed_run(root, shm):
    run = root / "run1"
    proc = train(run, "--steps", str(STEPS), "--save-every", "100", "--snapshot-every", "1",
                 "--memory-root", str(shm), "--fault", f"kill:0:{KILL_AT}", check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    return run


def _steps(client, run="run1"):
    return {x["training_step"]: x for x in client.get(f"/v1/runs/{run}/steps").json()}


def test_a_killed_rank_resumes_from_memory_and_ends_bitwise_equal(ms, reference, served, tmp_path):
    root, shm, client, proc, log = served
    run = _killed_run(root, shm)
    # the daemon persisted steps 5 and 10 from memory; they are ingested and verified as files
    wait_for(lambda: {5, 10} <= {s for s, x in _steps(client).items() if "file" in (x.get("tiers") or [])},
             timeout=60, what="persisted steps verified as files")
    # the snapshot of step 12 was copied right before the kill; its commit (hash, then the commit
    # word, on a background thread) may not have happened: then step 11 is the newest whole one
    def in_memory():
        steps = _steps(client)
        return steps if steps.get(11, {}).get("tiers") == ["memory"] else None

    steps = wait_for(in_memory, timeout=30, what="step 11 in memory")
    newest = 12 if 12 in steps else 11
    assert steps[newest]["tiers"] == ["memory"] and steps[newest]["state"] == "incomplete"
    assert steps[10]["tiers"] == ["file"]  # its slot was overwritten since: only the file holds it now
    # byte for byte what mindspore.save_checkpoint wrote for the same step in the uninterrupted run
    for step in (5, 10):
        assert read(shard(run, 0, step)) == read(shard(reference, 0, step))

    answer = resume_of(proc, client, log, "run1")
    assert answer["step"] == newest and answer["tier"] == "memory", answer  # RPO <= 1 step
    [slot] = answer["shards"]
    assert slot["path"].startswith(str(shm)) and slot["location"].startswith("memory://")
    resume_file = tmp_path / "answer.json"
    resume_file.write_text(__import__("json").dumps(answer))
    resumed = train(run, "--steps", str(STEPS), "--save-every", "100", "--snapshot-every", "1",
                    "--memory-root", str(shm), "--resume-from", str(resume_file))
    assert f"resumed from step {newest} (memory:" in resumed.stdout
    final = load(ms, shard(run, 0, STEPS))
    want = load(ms, shard(reference, 0, STEPS))
    assert final.keys() == want.keys()
    for name in want:
        assert final[name].tobytes() == want[name].tobytes(), name
    # a clean end releases the run's memory: its copies go, and the steps only memory held with them
    wait_for(lambda: not any("memory" in (x.get("tiers") or []) for x in _steps(client).values()),
             timeout=30, what="memory copies released")
    assert [e.name for e in os.scandir(shm)] == [".persist-every"]  # the run's region is gone


def test_with_the_memory_wiped_the_job_resumes_from_the_last_persisted_file(ms, reference, served, tmp_path):
    root, shm, client, proc, log = served
    run = _killed_run(root, shm)
    wait_for(lambda: 10 in {s for s, x in _steps(client).items() if "file" in (x.get("tiers") or [])},
             timeout=60, what="step 10 persisted")
    shutil.rmtree(shm)  # the node rebooted, or /dev/shm was cleared
    wait_for(lambda: not any("memory" in (x.get("tiers") or []) for x in _steps(client).values()),
             timeout=30, what="the daemon noticed the slots are gone")
    answer = resume_of(proc, client, log, "run1")
    assert answer["step"] == 10 and answer["tier"] == "file", answer
    resume_file = tmp_path / "answer.json"
    resume_file.write_text(__import__("json").dumps(answer))
    train(run, "--steps", str(STEPS), "--save-every", "100", "--resume-from", str(resume_file))
    final, want = load(ms, shard(run, 0, STEPS)), load(ms, shard(reference, 0, STEPS))
    for name in want:
        assert final[name].tobytes() == want[name].tobytes(), name
