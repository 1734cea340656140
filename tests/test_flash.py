"""Flash checkpoints end to end (issue 22): the real trainer snapshots every step into a memory
root, a real ``ckptd serve`` catalogues the slots, persists every 5th step as a file, and answers
a resume from memory; the resumed job ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.api_helpers import resume_of, serve_process, stop_process
from tests.daemon_helpers import migrated_sqlite, wait_for
from ckptd.storage import memslot
from tests.trainer_helpers import REPO, TINY, env, load, read, shard, train

STEPS = 14
KILL_AT = 13  # the rank dies at the start of step 13: steps 1-12 are done
PERSIST = 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, saving files every 5 steps with MindSpore's own save_checkpoint."""
    d = tmp_path_factory.mktemp("ref") / "run1"
    train(d, "--steps", str(STEPS), "--save-every", str(PERSIST), "--sync-save")
    return d


@contextlib.contextmanager
def _serve(tmp_path, **env: str):
    """A real ``ckptd serve`` with a memory root, persisting every 5th step: (root, shm, client, proc, log)."""
    root, shm = tmp_path / "root", tmp_path / "shm"
    root.mkdir()
    log = tmp_path / "serve.log"
    proc, client = serve_process(root, migrated_sqlite(tmp_path / "c.db"), log, "--persist-every", str(PERSIST),
                                 "--memory-root", str(shm), **env)
    try:
        wait_for(lambda: resume_of(proc, client, log, "none") is None and _up(client), timeout=60, what="serve up")
        yield root, shm, client, proc, log
    finally:
        stop_process(proc)


@pytest.fixture
def served(tmp_path):
    with _serve(tmp_path, CKPTD_MEMORY_SCRUB_AFTER="0.5") as s:
        yield s


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


def _settled(client, run="run1") -> None:
    """As the launcher does after a crash: the barrier answers once ckptd judged what the job left,
    its memory slots included (a scan that started after the question)."""
    doc = client.get(f"/v1/runs/{run}/settled", params={"wait": 60}, timeout=90).json()
    assert doc["settled"], doc


def _steps(client, run="run1"):
    return {x["training_step"]: x for x in client.get(f"/v1/runs/{run}/steps").json()}


def test_a_killed_rank_resumes_from_memory_and_ends_bitwise_equal(ms, reference, served, tmp_path):
    root, shm, client, proc, log = served
    run = _killed_run(root, shm)
    _settled(client)
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
    from prometheus_client.parser import text_string_to_metric_families

    metrics = {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
    assert metrics["ckptd_memory_persisted_total"] == 2 and metrics["ckptd_memory_snapshots_total"] >= 3
    assert metrics["ckptd_memory_bytes_read_total"] > 0

    answer = resume_of(proc, client, log, "run1")
    assert answer["step"] == newest and answer["tier"] == "memory", answer  # RPO <= 1 step
    [slot] = answer["shards"]
    assert slot["path"].startswith(str(shm)) and slot["location"].startswith("memory://")
    from ckptd.storage import memslot

    held = memslot.open_snapshot(slot["path"])  # the digest the daemon verified is the slot's own
    assert held is not None and slot["digest"] == held.digest and held.table.global_step == newest
    held.close()
    resumed = train(run, "--steps", str(STEPS), "--save-every", "100", "--snapshot-every", "1",
                    "--memory-root", str(shm), "--resume-from", _answer_file(tmp_path, answer))
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
    train(run, "--steps", str(STEPS), "--save-every", "100", "--resume-from", _answer_file(tmp_path, answer))
    final, want = load(ms, shard(run, 0, STEPS)), load(ms, shard(reference, 0, STEPS))
    for name in want:
        assert final[name].tobytes() == want[name].tobytes(), name


def _answer_file(tmp_path, answer) -> str:
    path = tmp_path / "answer.json"
    path.write_text(json.dumps(answer))
    return str(path)


def test_a_rank_killed_in_the_middle_of_a_copy_resumes_from_the_previous_snapshot(ms, reference, served, tmp_path):
    root, shm, client, proc, log = served
    run = root / "run1"
    out = train(run, "--steps", str(STEPS), "--save-every", "100", "--snapshot-every", "1", "--memory-root", str(shm),
                "--fault", "kill-in-snapshot:0:9", check=False)
    assert out.returncode == -9 and "in the middle of its snapshot of step 9" in out.stdout, out.stdout[-2000:]
    slots = sorted((shm / memslot.run_key(str(run)) / "rank_0").iterdir())
    assert sorted(memslot.commit_word(p.read_bytes()[:memslot.PAGE]) == 0 for p in slots) == [False, True]
    _settled(client)  # it waits for a scan of the slots as the crash left them
    answer = resume_of(proc, client, log, "run1")
    assert answer is not None and answer["step"] == 8 and answer["tier"] == "memory", answer  # never the torn slot
    train(run, "--steps", str(STEPS), "--save-every", "100", "--resume-from", _answer_file(tmp_path, answer))
    final, want = load(ms, shard(run, 0, STEPS)), load(ms, shard(reference, 0, STEPS))
    for name in want:
        assert final[name].tobytes() == want[name].tobytes(), name


def test_a_flipped_byte_in_a_committed_slot_is_corrupt_and_never_answered(served, tmp_path):
    root, shm, client, proc, log = served
    run = _killed_run(root, shm)
    region = shm / memslot.run_key(str(run)) / "rank_0"
    wait_for(lambda: resume_of(proc, client, log, "run1"), timeout=30, what="an answer")
    newest = memslot.newest([str(p) for p in sorted(region.iterdir())])
    step, path = newest.table.global_step, newest.path
    off = newest.payload_off
    newest.close()
    with open(path, "r+b") as fh:  # bit rot in RAM after the daemon verified the slot
        fh.seek(off + 11)
        b = fh.read(1)
        fh.seek(off + 11)
        fh.write(bytes([b[0] ^ 0x04]))

    def judged():
        doc = client.get(f"/v1/runs/run1/steps/{step}").json()
        return doc if any(c["state"] == "corrupt" for c in doc["copies_without_file"]) else None

    doc = wait_for(judged, timeout=30, what="the idle slot scrubbed")  # CKPTD_MEMORY_SCRUB_AFTER=0.5
    bad = [c for c in doc["copies_without_file"] if c["state"] == "corrupt"]
    assert "digest mismatch" in bad[0]["error"]
    answer = resume_of(proc, client, log, "run1")
    # never answered from the damaged slot (the step may still be whole through another verified copy)
    assert answer["tier"] == "memory" and all(sh["location"] != bad[0]["location"] for sh in answer["shards"]), answer


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for a private tmpfs")
def test_too_little_shared_memory_is_said_at_start_and_training_goes_on_with_files(tmp_path):
    """A real 256 KiB tmpfs as the memory root: the trainer says what it needs and what is free,
    and trains to the end with its file saves."""
    small, run = tmp_path / "small", tmp_path / "root" / "run1"
    small.mkdir()
    cmd = " ".join([sys.executable, "-m", "trainer.train", "--run-dir", str(run), *TINY, "--steps", "6",
                    "--save-every", "3", "--snapshot-every", "1", "--memory-root", str(small / "ckptd")])
    out = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=256k none {small} && {cmd}"],
                         cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if "memory tier off" in l)
    assert re.search(r"needs \d+ bytes for rank 0's two slots \(\d+ each\) in .*, and \d+ bytes are free", line), line
    assert "file checkpoints go on" in line
    assert os.path.exists(shard(run, 0, 3)) and os.path.exists(shard(run, 0, 6))


def test_the_daemon_releases_the_memory_of_a_run_no_job_writes_any_more(tmp_path):
    with _serve(tmp_path, CKPTD_MEMORY_RELEASE_AFTER="3") as (root, shm, client, proc, log):
        run = _killed_run(root, shm)  # a crashed job nobody restarts
        region = shm / memslot.run_key(str(run))
        wait_for(lambda: not region.exists(), timeout=60, what="the region released")
        wait_for(lambda: not any("memory" in (x.get("tiers") or []) for x in _steps(client).values()),
                 timeout=30, what="its copies gone")
        answer = resume_of(proc, client, log, "run1")
        assert answer["tier"] == "file" and answer["step"] == 10, answer  # the last persisted step
        assert 11 not in _steps(client)  # a step only memory held went with it
