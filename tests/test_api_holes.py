"""Issue 26's API holes, each against a real server and a real catalog: /metrics label values from
hostile run names, OPTIONS/405 ``Allow``, a catalog that is read-only or gone (503, never 500 or a
lost write), ``to_layout`` bounds (400 before any job; a step's bytes bound before planning), job
cancellation, the node-name bound and the resume hint's flag."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import threading

import pytest
from sqlalchemy import create_engine, text

from ckptd.split import parse_split
from ckptd.settings import Settings
from ckptd.storage import PosixStorage
from tests.api_helpers import Server
from tests.daemon_helpers import query, save_shard, wait_for, write_tp_strategy

TOKENS = {"r-token": "read", "a-token": "admin"}


@pytest.fixture
def sqlite_url(tmp_path):
    from tests.daemon_helpers import migrated_sqlite

    return migrated_sqlite(tmp_path / "catalog.db")


def _server(root, url, **overrides) -> Server:
    return Server(Settings(root=root, db=url, settle_seconds=0.2, rescan_interval=0.5, tokens=TOKENS, **overrides))


def _verified_step(ms, srv, root, run="run1", step=100):
    write_tp_strategy(root / run)
    for rank in range(2):
        save_shard(ms, root, run, rank, step)
    srv.settle()
    r = srv.client("r-token").get(f"/v1/runs/{run}/steps/{step}")
    assert r.status_code == 200 and r.json()["state"] == "verified", r.text


def _wait_job(srv, job_id, timeout=60):
    c = srv.client("r-token")
    return wait_for(lambda: (j := c.get(f"/v1/jobs/{job_id}").json())["state"] in ("done", "failed") and j,
                    timeout, what=f"job {job_id} to end")


# --- finding 6: /metrics label values ------------------------------------------------------------

_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(rf"^[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{{{_LABEL}(?:,{_LABEL})*\}})? \S+$")


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def test_metrics_escape_label_values_a_run_name_cannot_forge_a_line(ms, root, sqlite_url):
    evil = 'run"} 1\nckptd_shards{state="verified"} 424242\nz\\'  # a directory name may hold all of these
    with _server(root, sqlite_url) as srv:
        write_tp_strategy(root / evil)
        for rank in range(2):
            save_shard(ms, root, evil, rank, 100)
        srv.settle()  # no API path names such a run: the catalog and /metrics do
        assert query(sqlite_url, "SELECT state FROM checkpoints") == [("verified",)]
        body = srv.client("r-token").get("/metrics").text
    lines = body.splitlines()
    assert not [ln for ln in lines if not ln.startswith("# ") and not _SAMPLE.match(ln)], body
    assert "ckptd_shards{state=\"verified\"} 424242" not in lines
    (label,) = [m.group(1) for ln in lines if (m := re.match(r'^ckptd_recovery_point_seconds\{run="(.*)"\} \S+$', ln))]
    assert _unescape(label) == evil
    assert [float(ln.split()[-1]) for ln in lines if ln.startswith('ckptd_shards{state="verified"} ')] == [2]


# --- low: OPTIONS and 405 list every method of the path ------------------------------------------


def test_options_and_405_name_every_method_of_every_route(root, sqlite_url):
    with _server(root, sqlite_url) as srv:
        c = srv.client()
        methods = {path: {m.upper() for m in ops} for path, ops in c.get("/openapi.json").json()["paths"].items()}
        assert {"/v1/runs/{run}/conversions", "/v1/runs/{run}/health"} <= set(methods)
        for path, allowed in sorted(methods.items()):
            concrete = path.replace("{run}", "run1").replace("{step}", "1").replace("{job_id}", "1")
            want = allowed | {"OPTIONS"}
            r = c.options(concrete)
            assert r.status_code == 204, (path, r.status_code, r.text)
            assert set(r.headers["allow"].split(", ")) == want, (path, r.headers["allow"])
            r = c.request("PATCH", concrete)
            assert r.status_code == 405 and r.json()["detail"]["code"] == "method_not_allowed", (path, r.text)
            assert set(r.headers["allow"].split(", ")) == want, (path, r.headers["allow"])


# --- finding 8: a catalog that is read-only or gone ----------------------------------------------


def _unavailable(r) -> str:
    assert r.status_code == 503, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert detail["code"] == "catalog_unavailable" and "SELECT" not in r.text and "UPDATE" not in r.text, r.text
    return detail["message"]


def _writes_refused(srv) -> None:
    admin = srv.client("a-token")
    _unavailable(admin.post("/v1/runs/run1/steps/100/mark-bad", json={"reason": "x"}))
    _unavailable(admin.post("/v1/runs/run1/verify", json={"step": 100}))
    health = srv.client().get("/healthz")
    assert health.status_code == 503 and health.json()["status"] == "catalog_unavailable", health.text
    assert health.json()["catalog"] != "ok"


def _writes_work(srv) -> None:
    admin = srv.client("a-token")
    r = admin.post("/v1/runs/run1/steps/100/mark-bad", json={"reason": "after the repair"})
    assert r.status_code == 200 and r.json()["marked_bad"], r.text
    health = srv.client().get("/healthz")
    assert health.status_code == 200 and health.json()["catalog"] == "ok", health.text


def test_a_deleted_sqlite_catalog_is_503_and_no_write_is_lost(ms, root, tmp_path, sqlite_url):
    db = tmp_path / "catalog.db"
    with _server(root, sqlite_url) as srv:
        _verified_step(ms, srv, root)
        assert srv.client("r-token").get("/v1/runs/run1/resume").status_code == 200  # cached from now on
        backup = tmp_path / "backup"
        backup.mkdir()
        for f in tmp_path.glob("catalog.db*"):
            shutil.copy2(f, backup / f.name)
        for f in tmp_path.glob("catalog.db*"):
            f.unlink()
        admin = srv.client("a-token")
        message = _unavailable(admin.post("/v1/runs/run1/steps/100/mark-bad", json={"reason": "lost?"}))
        assert "gone" in message, message
        _writes_refused(srv)
        for _ in range(2):  # the resume fast path too (a cached answer's generation is looked up)
            _unavailable(srv.client("r-token").get("/v1/runs/run1/resume"))
        assert not db.exists(), "a new empty catalog was created in place of the deleted one"
        for f in backup.iterdir():  # the operator restores the catalog: the daemon uses it again
            shutil.copy2(f, tmp_path / f.name)
        _writes_work(srv)
    assert query(sqlite_url, "SELECT bad_reason FROM checkpoints WHERE step = 100") == [("after the repair",)]


def test_a_read_only_sqlite_catalog_is_503_while_reads_still_answer(ms, root, tmp_path, sqlite_url):
    db = tmp_path / "catalog.db"
    with _server(root, sqlite_url) as srv:
        _verified_step(ms, srv, root)
        os.chmod(db, 0o444)
        immutable = os.geteuid() == 0  # root writes a 0444 file anyway: the immutable flag binds root too
        if immutable:
            subprocess.run(["chattr", "+i", str(db)], check=True)
        try:
            message = _unavailable(srv.client("a-token").post("/v1/runs/run1/steps/100/mark-bad", json={}))
            assert "read-only" in message, message
            _writes_refused(srv)
            r = srv.client("r-token").get("/v1/runs/run1/steps/100")
            assert r.status_code == 200 and not r.json()["marked_bad"], r.text
        finally:
            if immutable:
                subprocess.run(["chattr", "-i", str(db)], check=True)
            os.chmod(db, 0o644)
        _writes_work(srv)


@pytest.mark.parametrize("catalog_url", ["postgresql"], indirect=True)
def test_a_read_only_postgresql_catalog_is_503(ms, root, catalog_url):
    dbname = catalog_url.rsplit("/", 1)[1]
    admin_engine = create_engine(catalog_url.replace("postgresql://", "postgresql+psycopg://", 1),
                                 isolation_level="AUTOCOMMIT")

    def reconnect_all(read_only: bool) -> None:  # a failover: every session of the daemon is new
        with admin_engine.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = '
                              + ("on" if read_only else "off")))
            conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": dbname})

    try:
        with _server(root, catalog_url) as srv:
            _verified_step(ms, srv, root)
            reconnect_all(True)
            message = _unavailable(srv.client("a-token").post("/v1/runs/run1/steps/100/mark-bad", json={}))
            assert "read-only" in message, message
            _writes_refused(srv)
            reconnect_all(False)
            _writes_work(srv)
    finally:
        admin_engine.dispose()


# --- finding 7: to_layout bounds and cancellation ------------------------------------------------


@pytest.mark.parametrize("layout, says", [
    ("tp=2", "needs dp"), ("dp=2", "needs tp"), ("tp=2,dp=2,tp=1", "twice"), ("tp=2,dp=x", "bad"),
    ("tp=2,dp=0", "bad"), ("tp=2,dp=2,zz=1", "bad"), ("tp=2,dp=999999", "ranks"), ("tp=2,dp=1,pp=999999", "ranks"),
])
def test_a_bad_to_layout_is_400_before_any_job(ms, root, sqlite_url, layout, says):
    with _server(root, sqlite_url) as srv:
        _verified_step(ms, srv, root)
        r = srv.client("a-token").post("/v1/runs/run1/conversions", json={"step": 100, "to_layout": layout})
        assert r.status_code == 400, (layout, r.status_code, r.text)
        assert says in r.json()["detail"]["message"], r.text
        assert srv.client("r-token").get("/v1/jobs").json() == []


def _inventory_and_strategy(ms, tmp_path):
    from ckptd.convert.execute import read_inventory
    from ckptd.format.strategy import load_strategy

    run = tmp_path / "src"
    strategy = load_strategy(str(write_tp_strategy(run)))
    for rank in range(2):
        save_shard(ms, tmp_path, "src", rank, 1)
    return read_inventory({r: str(run / f"rank_{r}" / "net-1_1.ckpt") for r in range(2)}, None), strategy


@pytest.mark.timeout(120)
def test_a_huge_data_parallel_target_is_refused_before_planning(ms, tmp_path):
    from ckptd.convert import derive_strategy, plan_conversion
    from ckptd.convert.plan import ConvertError

    inventory, src = _inventory_and_strategy(ms, tmp_path)
    with pytest.raises(ConvertError, match="bytes") as err:
        plan_conversion(inventory, src, derive_strategy(src, tp=1, dp=999999))  # planned for ever before
    assert "999999 destination ranks" in str(err.value), err.value
    plan = plan_conversion(inventory, src, derive_strategy(src, tp=1, dp=4))  # a real re-layout still plans
    assert len(plan.ranks) == 4


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 4), (2, 3), (2, 40), (1, 100)])
def test_the_request_estimate_never_exceeds_what_the_planner_counts(ms, tmp_path, tp, dp):
    """The API's estimate (:func:`least_output_bytes`, strategies and byte counts only) is a lower
    bound of the planner's exact count: below the estimate the planner refuses too, so the request
    check refuses nothing the job would have converted."""
    from ckptd.convert import derive_strategy, plan_conversion
    from ckptd.convert.plan import ConvertError, least_output_bytes

    inventory, src = _inventory_and_strategy(ms, tmp_path)
    source_bytes = sum(e.nbytes for s in inventory for e in s.entries)
    dst = derive_strategy(src, tp=tp, dp=dp)
    least = least_output_bytes(source_bytes, src, dst)
    assert least >= dp * source_bytes // 2  # not vacuous: dp copies of everything (the 2 source ranks' b: half that)
    with pytest.raises(ConvertError, match="bytes"):
        plan_conversion(inventory, src, dst, max_output_bytes=least - 1)


def test_a_conversion_beyond_the_bytes_bound_is_400_before_any_job(ms, root, sqlite_url):
    """tp=2,dp=2000 of a 2-rank step would write ~2,000x its bytes: refused by the request check
    (from the catalog's shard sizes and strategy, the planner's own bound), not a 202 and a failed
    job; and a direct conversion (``ckptd convert --run`` runs the same function) is still refused by
    the planner before a byte is written."""
    from ckptd.convert.plan import ConvertError
    from ckptd.service import conversions

    with _server(root, sqlite_url) as srv:
        _verified_step(ms, srv, root)
        r = srv.client("a-token").post("/v1/runs/run1/conversions", json={"step": 100, "to_layout": "tp=2,dp=2000"})
        assert r.status_code == 400, r.text
        detail = r.json()["detail"]
        assert detail["message"].startswith("to_layout 'tp=2,dp=2000': the conversion would write about "), detail
        assert "4000 destination ranks" in detail["message"] and "64 x the source step's" in detail["message"], detail
        assert "dp=N writes them N times" in detail["hint"], detail
        assert srv.client("r-token").get("/v1/jobs").json() == []
        assert query(sqlite_url, "SELECT count(*) FROM jobs") == [(0,)]
        assert query(sqlite_url, "SELECT count(*) FROM conversion_jobs") == [(0,)]
        assert not (root / "run1" / "converted").exists()
        ok = srv.client("a-token").post("/v1/runs/run1/conversions", json={"step": 100, "to_layout": "tp=2,dp=8"})
        assert ok.status_code == 202, ok.text  # 8x: within the bound
        assert _wait_job(srv, ok.json()["id"])["state"] == "done"
        with pytest.raises(ConvertError, match="bytes to 4000 destination ranks"):  # the second line of defence
            conversions.convert_step(srv.daemon.sessions, PosixStorage(str(root)), "run1", 100, split=parse_split("tp=2,dp=2000"))
        converted = root / "run1" / "converted"
        assert len(list(converted.iterdir())) == 1, list(converted.rglob("*"))  # the dp=8 copy only


def test_a_running_conversion_is_cancelled_at_its_next_progress_report(ms, root, sqlite_url):
    """The runner's own progress callback stops the job; the test cancels from inside the first
    report (the one moment a conversion is certainly running and has written some output)."""
    from ckptd.service import conversions

    with _server(root, sqlite_url) as srv:
        _verified_step(ms, srv, root)
        runner, ids, known = srv.daemon.jobs, [], threading.Event()

        def work(progress):
            known.wait(30)  # the job's id, once start() returned it

            def first_report_cancels(done, total):
                if done < total:
                    runner.cancel(ids[0])
                progress(done, total)
            return conversions.convert_step(srv.daemon.sessions, PosixStorage(str(root)), "run1", 100, split=parse_split("tp=1,dp=4"),
                                            progress=first_report_cancels)

        ids.append(runner.start("convert", "run1", {"step": 100}, 0, work)["id"])
        known.set()
        job = _wait_job(srv, ids[0])
        assert job["state"] == "failed" and job["error"].startswith("cancelled by an operator"), job
        (conv,) = srv.client("r-token").get("/v1/runs/run1/conversions").json()
        assert conv["state"] == "failed" and conv["error"].startswith("cancelled"), conv
        out = conv["out_dir"]
        assert os.path.isdir(out) and os.listdir(out) == [], os.listdir(out)  # temp tree removed, nothing renamed


@pytest.mark.timeout(240)
@pytest.mark.parametrize("catalog_url", ["postgresql"], indirect=True)
def test_jobs_are_cancelled_over_http_queued_at_once_running_at_their_next_report(ms, root, catalog_url):
    locker = create_engine(catalog_url.replace("postgresql://", "postgresql+psycopg://", 1))
    lock = None
    try:
        with _server(root, catalog_url) as srv:
            _verified_step(ms, srv, root)
            admin, reader = srv.client("a-token"), srv.client("r-token")
            lock = locker.connect()
            lock.begin()
            lock.execute(text("SELECT id FROM checkpoints FOR UPDATE")).all()  # wedges the verify job
            verify = admin.post("/v1/runs/run1/verify", json={"step": 100}).json()
            wait_for(lambda: reader.get(f"/v1/jobs/{verify['id']}").json()["state"] == "running", 30,
                     what="the verify job running")
            conv = admin.post("/v1/runs/run1/conversions", json={"step": 100, "to_layout": "tp=1,dp=2"})
            assert conv.status_code == 202, conv.text
            assert reader.post(f"/v1/jobs/{conv.json()['id']}/cancel").status_code == 403
            r = admin.post(f"/v1/jobs/{conv.json()['id']}/cancel")
            assert r.status_code == 200 and r.json()["state"] == "failed", r.text
            assert r.json()["error"].startswith("cancelled by an operator"), r.text
            r = admin.post(f"/v1/jobs/{verify['id']}/cancel")
            assert r.status_code == 202 and r.json()["state"] == "running" and r.json()["cancel_requested"], r.text
            lock.rollback()
            lock.close()
            lock = None
            job = _wait_job(srv, verify["id"])
            assert job["state"] == "failed" and job["error"].startswith("cancelled by an operator"), job
            assert _wait_job(srv, conv.json()["id"])["error"].startswith("cancelled by an operator")
            assert reader.get("/v1/runs/run1/conversions").json() == []  # the queued one never ran
            r = admin.post(f"/v1/jobs/{verify['id']}/cancel")
            assert r.status_code == 409 and r.json()["detail"]["code"] == "conflict", r.text
            assert admin.post("/v1/jobs/999999/cancel").status_code == 404
    finally:
        if lock is not None:
            lock.rollback()
            lock.close()
        locker.dispose()


# --- low: node-name bound, the resume hint's flag ------------------------------------------------


def test_node_names_are_bounded_so_the_marker_file_name_fits(root, sqlite_url):
    from pydantic import ValidationError

    from ckptd.daemon import Daemon

    with pytest.raises(ValidationError, match="225"):
        Settings(root=root, db=sqlite_url, node_name="n" * 226)
    longest = "n" * 225  # its marker's temp name is 255 bytes long for a 7-digit pid
    d = Daemon(Settings(root=root, db=sqlite_url, node_name=longest))
    d.start()
    try:
        assert (root / f".ckptd-node-{longest}").is_file()
    finally:
        d.stop()


def test_cli_refuses_a_too_long_node_name_in_one_line(root, sqlite_url):
    import sys

    r = subprocess.run([sys.executable, "-m", "ckptd", "watch", "--root", str(root), "--db", sqlite_url],
                       env=dict(os.environ, CKPTD_NODE_NAME="n" * 250), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "node_name" in r.stderr and "225" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_the_no_restorable_step_hint_names_a_real_launcher_flag(ms, root, sqlite_url, capsys):
    from ckptd.cli import build_parser

    with _server(root, sqlite_url) as srv:
        _verified_step(ms, srv, root)
        r = srv.client("r-token").get("/v1/runs/run1/resume", params={"max_step": 5})
    assert r.status_code == 404 and r.json()["detail"]["code"] == "no_restorable_step", r.text
    flags = re.findall(r"--[a-z][a-z-]+", r.json()["detail"]["hint"])
    assert flags == ["--allow-fresh-start"], r.json()["detail"]
    with contextlib.suppress(SystemExit):
        build_parser().parse_args(["launch", "--help"])
    assert re.search(r"(^|\s)--allow-fresh-start(\s|,|$)", capsys.readouterr().out, re.M)
