"""A job wedged in I/O must not wedge ``ckptd serve`` (issue 15): ``/healthz`` names the job's
thread once it made no progress for ``worker_stall_seconds``, and SIGTERM still stops the server
(the job is failed as interrupted, for a restart to clean up after). The wedge is real: a catalog
row another client keeps locked (an operator's open transaction in psql) blocks the job's write.
No mocks; a hang fails by the test's own deadlines."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from sqlalchemy import create_engine, text

from tests.api_helpers import stop_process
from tests.daemon_helpers import query, save_shard, wait_for, write_tp_strategy

ADMIN = "admin-token-for-wedged-jobs"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("catalog_url", ["postgresql"], indirect=True)
def test_a_wedged_job_makes_healthz_stalled_and_sigterm_still_stops(ms, tmp_path, catalog_url):
    from tests.api_helpers import serve_process

    root = tmp_path / "root"
    write_tp_strategy(root / "run")
    for rank in range(2):
        save_shard(ms, root, "run", rank, 2)
    log = tmp_path / "serve.log"
    proc, client = serve_process(root, catalog_url, log, CKPTD_WORKER_STALL_SECONDS="1",
                                 CKPTD_TOKENS=json.dumps({ADMIN: "admin"}))
    client.headers["Authorization"] = f"Bearer {ADMIN}"
    locker = create_engine(catalog_url.replace("postgresql://", "postgresql+psycopg://", 1))
    lock = None
    try:
        def verified():
            assert proc.poll() is None, open(log).read()[-3000:]
            try:
                r = client.get("/v1/runs/run/steps/2")
            except Exception:
                return False
            return r.status_code == 200 and r.json()["state"] == "verified"

        wait_for(verified, 90, interval=0.2, what="step 2 verified")
        assert client.get("/healthz").status_code == 200
        lock = locker.connect()
        lock.begin()
        lock.execute(text("SELECT id FROM checkpoints FOR UPDATE")).all()  # held until the server is gone
        job = client.post("/v1/runs/run/verify", json={"step": 2})
        assert job.status_code == 202, job.text

        def stalled():
            r = client.get("/healthz")
            return r if r.status_code == 503 and "ckptd-jobs" in r.json()["stalled"] else None

        health = wait_for(stalled, 60, interval=0.2, what="/healthz naming the wedged job thread").json()
        assert health["status"] == "stalled"
        assert client.get(f"/v1/jobs/{job.json()['id']}").json()["state"] == "running"
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)  # the server's shutdown is bounded even with a job wedged
        except subprocess.TimeoutExpired:
            pytest.fail(f"ckptd serve did not stop on SIGTERM with a wedged job:\n{open(log).read()[-3000:]}")
        (state, error), = query(catalog_url, "SELECT state, error FROM jobs WHERE id = :id", id=job.json()["id"])
        assert state == "failed" and error.startswith("interrupted by shutdown"), (state, error)
    finally:
        if lock is not None:
            lock.rollback()
            lock.close()
        locker.dispose()
        client.close()
        stop_process(proc)
