"""SIGTERM to a real ``ckptd serve`` while a long conversion job runs (issue 26, finding 7: a
conversion held SIGTERM for 20 s; docs/ARCHITECTURE.md bounds shutdown at 10 s).

The conversion is held mid-way by the test harness (:mod:`tests.slow_convert`), deterministically:
``report`` -- alive and reporting progress, as a slow conversion does, so the shutdown stops it at
its next report (cooperatively: it removes its temp tree); ``wedge`` -- blocked without reporting,
so the shutdown waits the documented 10 s for it, then records it interrupted and exits without it
(its temp tree is left to the next start's ``recover_abandoned``). Either way: the process exits,
the job is failed with a reason, and no destination rank directory exists. The elapsed time is
printed; the only bound asserted is a generous one over the documented 10 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy.orm import sessionmaker

from ckptd.catalog.db import make_engine
from ckptd.convert.execute import TMP_PREFIX
from ckptd.service import jobs
from ckptd.service.jobrunner import SHUTDOWN_RUNNING
from ckptd.storage import PosixStorage
from tests.api_helpers import free_port
from tests.daemon_helpers import query, save_shard, wait_for, write_tp_strategy

REPO = Path(__file__).resolve().parent.parent
ADMIN = "shutdown-admin-token"
DOCUMENTED_BOUND = 10.0  # docs/ARCHITECTURE.md: "a job still running 10 s later fails as interrupted by shutdown"
GENEROUS = 3 * DOCUMENTED_BOUND  # process start-up of the interpreter, shared CI cores: never a tight figure
ROWS, COLS = 1024, 2048  # "w" per rank: 8 MiB of float32, so the output is written in several reports


def _step(ms, root: Path) -> None:
    write_tp_strategy(root / "run1")
    for rank in range(2):
        w = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + rank
        save_shard(ms, root, "run1", rank, 100, tensors={"w": w, "b": np.full(3, 1.0, np.float32)})


def _serve(tmp: Path, root: Path, db: str, mode: str, marker: Path) -> tuple[subprocess.Popen, httpx.Client, Path]:
    tokens = tmp / "tokens"
    tokens.write_text(f"admin {ADMIN}\n")
    port = free_port()
    log = tmp / f"serve-{port}.log"
    env = dict(os.environ, CKPTD_SETTLE_SECONDS="0.2", CKPTD_RESCAN_INTERVAL="1", PYTHONPATH=str(REPO),
               CKPTD_TOKEN_FILE=str(tokens), CKPTD_TEST_SLOW_MARKER=str(marker))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.slow_convert", mode, "--", "serve", "--root", str(root),
                                 "--port", str(port), "--db", db], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"ckptd serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return bool(client.get("/healthz").json().get("first_rescan_done"))
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=60, interval=0.2, what="ckptd serve to come up")
    return proc, client, log


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["report", "wedge"])
def test_sigterm_with_a_running_conversion_exits_within_the_bound_and_fails_the_job(ms, root, catalog_url, tmp_path,
                                                                                      mode):
    _step(ms, root)
    marker = tmp_path / "held"
    proc, client, log = _serve(tmp_path, root, catalog_url, mode, marker)
    try:
        wait_for(lambda: query(catalog_url, "SELECT state FROM checkpoints") == [("verified",)], timeout=60,
                 what="step 100 verified")
        r = client.post("/v1/runs/run1/conversions", json={"step": 100, "to_strategy": "none"})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        wait_for(marker.exists, timeout=120, what="the conversion held mid-way")
        assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "running"
        (out,) = (root / "run1" / "converted").iterdir()
        assert [p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX)], list(out.iterdir())  # mid-way

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(GENEROUS)
        except subprocess.TimeoutExpired:
            code = None
        elapsed = time.monotonic() - t0
        print(f"{mode}: ckptd serve exited {code} {elapsed:.2f} s after SIGTERM (documented bound {DOCUMENTED_BOUND} s)")
        assert code is not None, (f"ckptd serve still running {GENEROUS} s after SIGTERM with a {mode} conversion "
                                  f"(documented bound {DOCUMENTED_BOUND} s):\n{log.read_text()[-3000:]}")
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    ((state, error),) = query(catalog_url, "SELECT state, error FROM jobs WHERE id = :i", i=job_id)
    assert state == "failed" and error == SHUTDOWN_RUNNING, (state, error, log.read_text()[-3000:])
    assert not [p for p in out.iterdir() if p.name.startswith("rank_")], list(out.iterdir())
    trees = [p for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]
    if mode == "report":  # stopped at its next report: it unwound as from its own error, removing its temp tree
        assert trees == [], trees
        ((cstate, cerror),) = query(catalog_url, "SELECT state, error FROM conversion_jobs")
        assert cstate == "failed" and cerror.startswith("interrupted by shutdown"), (cstate, cerror)
    else:  # it never reported again: left for the next start's recover_abandoned, like a killed process's
        assert len(trees) == 1, list(out.iterdir())
        engine = make_engine(catalog_url)
        try:
            report = jobs.recover_abandoned(sessionmaker(engine, expire_on_commit=False), PosixStorage(str(root)))
        finally:
            engine.dispose()
        assert report["removed"] == [str(trees[0])] and not trees[0].exists(), report
        ((cstate, cerror),) = query(catalog_url, "SELECT state, error FROM conversion_jobs")
        assert cstate == "failed" and cerror, (cstate, cerror)
