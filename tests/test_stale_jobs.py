"""Jobs and conversions left running by a dead process (issue 15, finding 4).

Real processes: a ``ckptd serve`` or ``ckptd convert --run`` is stopped half-way through a
conversion by the test harness (``tests.fault_convert``: SIGSTOP once 30 % of the output is
written, so the temp tree is half full), then SIGKILLed — or left alive — and a recovering
process (``jobs.recover_abandoned``, what the daemon runs at start) judges what it left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy.orm import sessionmaker

from ckptd.catalog.db import make_engine
from ckptd.catalog.models import Checkpoint, ConversionJob, Job, Run, as_utc
from ckptd.convert.execute import TMP_PREFIX
from ckptd.service import jobs
from ckptd.service.resume import RESUME_LEASE
from ckptd.settings import Settings
from ckptd.storage import PosixStorage
from tests.api_helpers import Server
from tests.daemon_helpers import query, save_shard, wait_for, write_tp_strategy
from tests.api_helpers import free_port, stop_process

REPO = Path(__file__).resolve().parent.parent
ADMIN = "stale-admin-token"
ROWS, COLS = 1024, 2048  # "w" per rank: 8 MiB of float32, so the output is written in several ticks


@pytest.fixture
def sessions(catalog_url):
    engine = make_engine(catalog_url)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


def _job(ms, root: Path) -> None:
    """run1: step 100 big (the one converted), step 200 small and newer (so gc would take 100)."""
    write_tp_strategy(root / "run1")
    for rank in range(2):
        w = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + rank
        save_shard(ms, root, "run1", rank, 100, tensors={"w": w, "b": np.full(3, 1.0, np.float32)})
        save_shard(ms, root, "run1", rank, 200)


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, CKPTD_SETTLE_SECONDS="0.2", CKPTD_RESCAN_INTERVAL="1", PYTHONPATH=str(REPO)) | extra


def _ckptd(*args: str, stop_mid_conversion: bool = False) -> list[str]:
    """The command line of a ckptd process; ``stop_mid_conversion``: it stops itself (SIGSTOP)
    once 30 % of a conversion's output is written."""
    if stop_mid_conversion:
        return [sys.executable, "-m", "tests.fault_convert", "0.3", "STOP", "--", *args]
    return [sys.executable, "-m", "ckptd", *args]


class Serve:
    """A ``ckptd serve`` process with an admin token."""

    def __init__(self, tmp: Path, root: Path, db: str, *, stop_mid_conversion: bool = False, **env: str) -> None:
        tokens = tmp / "tokens"
        tokens.write_text(f"admin {ADMIN}\n")
        self.port = free_port()
        self.log = tmp / f"serve-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                _ckptd("serve", "--root", str(root), "--port", str(self.port), "--db", db,
                       stop_mid_conversion=stop_mid_conversion),
                cwd=REPO, env=_env(CKPTD_TOKEN_FILE=str(tokens), **env), stdout=out, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}",
                                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)

        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"ckptd serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                return bool(self.client.get("/healthz").json().get("first_rescan_done"))
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=60, interval=0.2, what="ckptd serve to come up")

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        stop_process(self.proc)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


def _temp_trees(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"*/converted/*/{TMP_PREFIX}*"))


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _verified(url: str, steps: set[int]) -> bool:
    rows = query(url, "SELECT step, state FROM checkpoints WHERE kind = 'trained'")
    return {s for s, st in rows if st == "verified"} >= steps


def _conversion_states(url: str) -> list[tuple]:
    return query(url, "SELECT id, state, error FROM conversion_jobs ORDER BY id")


def _stop_mid_conversion(proc: subprocess.Popen, root: Path, url: str) -> Path:
    """Wait until ``proc`` stopped itself half-way; the running row and its half-full temp tree."""
    wait_for(lambda: proc.poll() is not None or _stopped(proc.pid), timeout=120, what="the conversion to stop half-way")
    assert proc.poll() is None, "the converting process exited instead of stopping"
    (tree,) = _temp_trees(root)
    assert _tree_bytes(tree) > 0
    assert [s for _, s, _ in _conversion_states(url)] == ["running"]
    return tree


def test_serve_killed_mid_conversion_is_failed_and_cleaned_by_the_next_process(ms, root, catalog_url, tmp_path, sessions):
    """Before: the row stayed ``running`` forever, the temp tree stayed, and retention kept the
    source step as "in use by a conversion" for good."""
    from ckptd.service.retention import lineage_ids
    from ckptd.service.resume import step_infos

    _job(ms, root)
    srv = Serve(tmp_path, root, catalog_url, stop_mid_conversion=True)
    try:
        wait_for(lambda: _verified(catalog_url, {100, 200}), timeout=60, what="steps verified")
        job = srv.client.post("/v1/runs/run1/conversions", json={"step": 100, "to_strategy": "none"})
        assert job.status_code == 202, job.text
        tree = _stop_mid_conversion(srv.proc, root, catalog_url)
        pid = srv.proc.pid
        srv.proc.kill()
        srv.proc.wait()
    finally:
        srv.stop()
    (conv_id, _, _), = _conversion_states(catalog_url)
    with sessions() as s:
        src_id = s.get(ConversionJob, conv_id).source_checkpoint_id
        assert src_id in lineage_ids(s)  # pinned against gc by a conversion nobody runs any more
    assert query(catalog_url, "SELECT state FROM jobs WHERE id = :i", i=job.json()["id"]) == [("running",)]

    report = jobs.recover_abandoned(sessions, PosixStorage(str(root)))  # what the next daemon start runs

    assert report["jobs"] == [{"id": job.json()["id"], "kind": "convert", "why": f"its process (pid {pid} on "
                               f"{socket.gethostname()}) is not running"}]
    assert [c["id"] for c in report["conversions"]] == [conv_id]
    assert report["removed"] == [str(tree)] and not tree.exists() and _temp_trees(root) == []
    assert report["refused"] == [] and report["left"] == []
    (_, state, error), = _conversion_states(catalog_url)
    assert state == "failed" and error.startswith(f"abandoned: its process (pid {pid} ") and "is not running" in error
    (jstate, jerror), = query(catalog_url, "SELECT state, error FROM jobs WHERE id = :i", i=job.json()["id"])
    assert jstate == "failed" and jerror.startswith("abandoned: ")
    now = datetime.now(timezone.utc)
    with sessions() as s:
        assert src_id not in lineage_ids(s)
        lease = s.get(Checkpoint, src_id).lease_until
        assert lease is not None and as_utc(lease) <= now + RESUME_LEASE  # a resume answer's lease at most
        # once a resume lease would have run out, retention may take the step again
        info = next(i for i in step_infos(s, s.get(Checkpoint, src_id).run_id, now + RESUME_LEASE) if i.id == src_id)
        assert not info.in_use
    assert jobs.recover_abandoned(sessions, PosixStorage(str(root))) == {"jobs": [], "conversions": [], "removed": [], "refused": [],
                                                           "left": []}  # idempotent

    # the same conversion again runs into nothing left behind
    srv = Serve(tmp_path, root, catalog_url)
    try:
        again = srv.client.post("/v1/runs/run1/conversions", json={"step": 100, "to_strategy": "none"}).json()
        done = wait_for(lambda: (j := srv.client.get(f"/v1/jobs/{again['id']}").json())["state"] in ("done", "failed")
                        and j, timeout=60, what="the conversion")
        assert done["state"] == "done", done
        assert done["owner"]["pid"] == srv.proc.pid and done["conversion_id"] == conv_id + 1
    finally:
        srv.stop()


def test_serve_restarted_after_a_kill_mid_conversion_recovers_by_itself(ms, root, catalog_url, tmp_path):
    _job(ms, root)
    srv = Serve(tmp_path, root, catalog_url, stop_mid_conversion=True)
    try:
        wait_for(lambda: _verified(catalog_url, {100, 200}), timeout=60, what="steps verified")
        assert srv.client.post("/v1/runs/run1/conversions", json={"step": 100, "to_strategy": "none"}).status_code == 202
        tree = _stop_mid_conversion(srv.proc, root, catalog_url)
        srv.proc.kill()
        srv.proc.wait()
    finally:
        srv.stop()
    srv = Serve(tmp_path, root, catalog_url)
    try:
        (_, state, error), = _conversion_states(catalog_url)
        assert state == "failed" and error.startswith("abandoned: ") and not tree.exists()
        (job,) = srv.client.get("/v1/jobs").json()
        assert job["state"] == "failed" and job["error"].startswith("abandoned: ")
    finally:
        srv.stop()


def _cli_convert(root: Path, url: str, stop_mid_conversion: bool = False) -> subprocess.Popen:
    return subprocess.Popen(_ckptd("convert", "--run", "run1", "--step", "100", "--to-strategy", "none", "--json",
                                   stop_mid_conversion=stop_mid_conversion),
                            cwd=REPO, env=_env(CKPTD_DB=url, CKPTD_ROOT=str(root)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _catalogued(ms, root: Path, url: str) -> None:
    _job(ms, root)
    with Server(Settings(root=root, db=url, settle_seconds=0.2)) as srv:
        srv.settle()
    assert _verified(url, {100, 200})


def test_conversion_of_a_live_process_is_left_alone(ms, root, catalog_url, sessions):
    """``ckptd convert --run`` is alive (stopped, not dead) while a daemon starts on the same
    machine: its job and conversion stay running, its temp tree stays, and it finishes."""
    _catalogued(ms, root, catalog_url)
    cli = _cli_convert(root, catalog_url, stop_mid_conversion=True)
    try:
        tree = _stop_mid_conversion(cli, root, catalog_url)
        (job,) = query(catalog_url, "SELECT id, kind, state, params FROM jobs")
        assert job[1:3] == ("convert", "running") and json.loads(job[3])["ckptd"]["owner"]["pid"] == cli.pid

        report = jobs.recover_abandoned(sessions, PosixStorage(str(root)), timeout=0.001)  # the pid says alive, whatever the clock
        assert report == {"jobs": [], "conversions": [], "removed": [], "refused": [], "left": []}
        assert tree.exists() and [s for _, s, _ in _conversion_states(catalog_url)] == ["running"]
    finally:
        os.kill(cli.pid, signal.SIGCONT)
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 0, err
    assert json.loads(out)["state"] == "done" and not tree.exists()
    assert query(catalog_url, "SELECT state FROM jobs") == [("done",)]
    with sessions() as s:
        doc = jobs.get_job(s, job[0])
    assert doc["conversion_id"] == json.loads(out)["id"] and doc["result"]["output_checkpoint_id"] is not None
    assert "ckptd" not in doc["params"] and doc["params"]["step"] == 100


def test_conversion_elsewhere_is_judged_by_its_heartbeat(ms, root, catalog_url, sessions, monkeypatch):
    """Seen from another machine (another boot id), a pid means nothing: the owner's heartbeat
    decides. The stopped ``ckptd convert`` renews nothing, so it counts as gone once it was silent
    for longer than the timeout — never before."""
    _catalogued(ms, root, catalog_url)
    cli = _cli_convert(root, catalog_url, stop_mid_conversion=True)
    try:
        tree = _stop_mid_conversion(cli, root, catalog_url)
        monkeypatch.setattr(jobs, "this_machine", lambda: {"host": "other-node", "boot": "another-boot", "pidns": "pid:[1]"})
        assert jobs.recover_abandoned(sessions, PosixStorage(str(root)), timeout=60)["jobs"] == []
        assert tree.exists()
        time.sleep(1.5)
        report = jobs.recover_abandoned(sessions, PosixStorage(str(root)), timeout=1.0)
        (j,) = report["jobs"]
        assert "renewed nothing for" in j["why"] and "(limit 1 s)" in j["why"]
        assert report["removed"] == [str(tree)]  # a shared disk: the dead owner's tree, by its host and pid
        assert [s for _, s, _ in _conversion_states(catalog_url)] == ["failed"]
    finally:
        cli.kill()
        cli.wait()


def _runner(sessions, interval: float = 0.1) -> jobs.JobRunner:
    return jobs.JobRunner(sessions, None, None, None, heartbeat_interval=interval)


def _run_row(sessions, root: Path) -> None:
    with sessions.begin() as s:
        s.add(Run(name="run1", path=str(root / "run1")))


def test_heartbeat_keeps_a_live_job_elsewhere_running(root, sessions, monkeypatch):
    _run_row(sessions, root)
    runner = _runner(sessions)
    release = threading.Event()
    try:
        doc = runner.start("verify", "run1", {"run": "run1"}, 1, lambda progress: release.wait(30) and {})
        assert doc["owner"]["pid"] == os.getpid()
        monkeypatch.setattr(jobs, "this_machine", lambda: {"host": "other-node", "boot": "another-boot", "pidns": "pid:[1]"})
        # two timeouts: only the heartbeat (every 0.1 s) keeps it alive; the timeout leaves room for
        # a catalog that stalls a beat on a loaded machine
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert jobs.recover_abandoned(sessions, PosixStorage(str(root)), timeout=1.5)["jobs"] == []
            time.sleep(0.1)
        with sessions() as s:
            assert s.get(Job, doc["id"]).state == "running"
    finally:
        release.set()
        runner.close()
    with sessions() as s:
        assert s.get(Job, doc["id"]).state == "done"


def test_jobs_queued_when_the_runner_stops_are_failed_not_left_queued(root, sessions):
    _run_row(sessions, root)
    runner = _runner(sessions)
    running, release = threading.Event(), threading.Event()
    first = runner.start("verify", "run1", {}, 1, lambda progress: running.set() or release.wait(30) and {})
    second = runner.start("verify", "run1", {}, 1, lambda progress: {})
    assert running.wait(10)  # close() before the thread took the first job would cancel both, rightly
    closing = threading.Thread(target=runner.close)
    closing.start()
    time.sleep(0.2)
    release.set()
    closing.join(30)
    with sessions() as s:
        assert s.get(Job, first["id"]).state == "done"
        queued = s.get(Job, second["id"])
        assert (queued.state, queued.error) == ("failed", "cancelled: ckptd stopped before the job ran")


def _dead_owner() -> dict:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return {**jobs.process_owner(), "pid": proc.pid, "start": None}


def _conversion(sessions, out_dir: str, owner: dict | None, *, age: timedelta = timedelta(0)) -> int:
    """A running conversion row (and its job, when ``owner`` is given) of a step of its own."""
    with sessions.begin() as s:
        run = s.query(Run).filter_by(name="run1").one()
        now = datetime.now(timezone.utc)
        step = 1 + s.query(Checkpoint).count()
        ckpt = Checkpoint(run_id=run.id, prefix="net", epoch=1, step=step, kind="trained", strategy_hash="",
                          state="verified", expected_ranks=1, pinned=False, marked_bad=False,
                          lease_until=now + timedelta(hours=2))
        s.add(ckpt)
        s.flush()
        row = ConversionJob(run_id=run.id, source_checkpoint_id=ckpt.id, target_strategy_hash="none", out_dir=out_dir,
                            state="running", created_at=now - age, updated_at=now - age)
        s.add(row)
        s.flush()
        if owner is not None:
            job = jobs.record_job(s, "convert", run.id, {"step": 1}, owner, state="running")
            jobs.link_conversion(s, job.id, row.id)
        return row.id


def test_temp_data_is_removed_only_inside_the_root_and_never_through_a_symlink(root, tmp_path, sessions):
    _run_row(sessions, root)
    outside = tmp_path / "outside"
    victim = outside / "victim"
    victim.mkdir(parents=True)
    (victim / "keep.ckpt").write_bytes(b"precious")
    dead = _dead_owner()
    host, pid = dead["host"], dead["pid"]
    tmp = f"{TMP_PREFIX}{host}-{pid}-"

    # 1. run1/converted is a symlink to a directory outside the root
    (outside / "conv" / "1-none" / f"{tmp}aaaaaaaa").mkdir(parents=True)
    (outside / "conv" / "1-none" / f"{tmp}aaaaaaaa" / "rank_0").mkdir()
    (root / "run1").mkdir()
    os.symlink(outside / "conv", root / "run1" / "converted")
    via_link = _conversion(sessions, str(root / "run1" / "converted" / "1-none"), dead)
    # 2. a real output directory holding: a temp-named symlink to the outside, a real temp tree with
    #    a symlink inside it, a live process's temp tree, and a rank directory renamed in before the kill
    real = root / "run1" / "conv2" / "2-none"
    real.mkdir(parents=True)
    os.symlink(victim, real / f"{tmp}bbbbbbbb")
    (real / f"{tmp}cccccccc").mkdir()
    os.symlink(victim, real / f"{tmp}cccccccc" / "rank_0")
    (real / f"{tmp}cccccccc" / "part.ckpt").write_bytes(b"x" * 100)
    live = real / f"{TMP_PREFIX}{host}-{os.getpid()}-dddddddd"
    live.mkdir()
    (real / "rank_0").mkdir()
    in_root = _conversion(sessions, str(real), dead)
    # 3. an output directory outside the root
    (outside / "far" / f"{tmp}eeeeeeee").mkdir(parents=True)
    far = _conversion(sessions, str(outside / "far"), dead)
    # 4. rows from before conversions recorded an owner: abandoned after the lease, not before
    legacy_old = _conversion(sessions, str(root / "run1" / "conv3"), None, age=timedelta(hours=3))
    legacy_new = _conversion(sessions, str(root / "run1" / "conv4"), None, age=timedelta(minutes=1))

    report = jobs.recover_abandoned(sessions, PosixStorage(str(root)))

    assert sorted(c["id"] for c in report["conversions"]) == sorted([via_link, in_root, far, legacy_old])
    assert report["removed"] == [str(real / f"{tmp}cccccccc")]
    assert not (real / f"{tmp}cccccccc").exists()
    assert os.path.islink(real / f"{tmp}bbbbbbbb") and live.is_dir()
    assert (victim / "keep.ckpt").read_bytes() == b"precious"
    assert (outside / "conv" / "1-none" / f"{tmp}aaaaaaaa" / "rank_0").is_dir()
    assert (outside / "far" / f"{tmp}eeeeeeee").is_dir()
    refused = "\n".join(report["refused"])
    assert "converted/1-none: outside the checkpoint root or reached through a symlink" in refused
    assert f"{outside / 'far'}: outside the checkpoint root" in refused
    assert f"{tmp}bbbbbbbb: not a directory" in refused
    (left,) = report["left"]
    assert "partial output ['rank_0']" in left
    states = dict((i, (st, err)) for i, st, err in _conversion_states_from(sessions))
    assert states[legacy_new][0] == "running" and states[legacy_old][0] == "failed"
    assert "no process recorded on it" in states[legacy_old][1]
    assert "partial output ['rank_0']" in states[in_root][1]


def _conversion_states_from(sessions) -> list[tuple]:
    with sessions() as s:
        return [(r.id, r.state, r.error) for r in s.query(ConversionJob).order_by(ConversionJob.id)]


def test_a_pid_reused_by_another_process_is_not_the_owner(root, sessions):
    _run_row(sessions, root)
    me = jobs.process_owner()
    assert jobs.owner_gone(me, None, datetime.now(timezone.utc)) is None
    reused = {**me, "start": me["start"] - 1}  # our pid, but the process that had it started earlier
    assert "belongs to a newer process" in jobs.owner_gone(reused, None, datetime.now(timezone.utc))


def test_start_removes_this_machines_tree_of_a_conversion_failed_elsewhere(root, sessions):
    """Another daemon failed the conversion while this node was down (it could not see this
    node's disk); at this node's next start its dead process's temp tree goes — at start only."""
    _run_row(sessions, root)
    dead = _dead_owner()
    out = root / "run1" / "converted" / "5-none"
    tree = out / f"{TMP_PREFIX}{dead['host']}-{dead['pid']}-0123abcd"
    tree.mkdir(parents=True)
    conv = _conversion(sessions, str(out), dead)
    with sessions.begin() as s:  # what the other daemon recorded
        row = s.get(ConversionJob, conv)
        row.state, row.error = "failed", "abandoned: its process (pid 1 on elsewhere) renewed nothing for 300 s"
        for job in s.query(Job).all():
            job.state, job.error = "failed", row.error
    periodic = jobs.recover_abandoned(sessions, PosixStorage(str(root)), at_start=False)
    assert periodic["removed"] == [] and tree.exists()
    assert jobs.recover_abandoned(sessions, PosixStorage(str(root)))["removed"] == [str(tree)] and not tree.exists()
    with sessions() as s:
        assert s.get(ConversionJob, conv).state == "failed"
