"""REST API over real HTTP against a real catalog (SQLite and PostgreSQL) and real MindSpore files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ckptd.settings import Settings
from tests.api_helpers import Server
from tests.daemon_helpers import query, save_shard, write_tp_strategy

TOKENS = {"r-token": "read", "p-token": "report", "a-token": "admin"}


@pytest.fixture
def server(root, catalog_url):
    settings = Settings(root=root, db=catalog_url, settle_seconds=0.2, rescan_interval=0.5, tokens=TOKENS)
    with Server(settings) as srv:
        yield srv


def _wait_job(server, job_id):
    import time

    deadline = time.monotonic() + 30
    while (j := server.client("r-token").get(f"/v1/jobs/{job_id}").json())["state"] not in ("done", "failed"):
        assert time.monotonic() < deadline, j
        time.sleep(0.05)
    return j


def _job(ms, root, steps=(100, 200, 300), ranks=2):
    write_tp_strategy(root / "run1")
    for step in steps:
        for rank in range(ranks):
            save_shard(ms, root, "run1", rank, step)


def test_resume_answers_newest_verified_step(ms, root, server):
    _job(ms, root)
    server.settle()
    r = server.client("r-token").get("/v1/runs/run1/resume")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["step"] == 300 and doc["epoch"] == 1 and doc["world_size"] == 2
    assert doc["strategy_file"] == str(root / "run1" / "strategy.ckpt")
    assert [{k: e[k] for k in ("rank", "path")} for e in doc["shards"]] == [{"rank": r, "path": str(root / "run1" / f"rank_{r}" / "net-1_300.ckpt")} for r in range(2)]
    assert {e["node"] for e in doc["shards"]} == {Settings().node_name} and doc["unreachable_nodes"] == []
    assert doc["skipped"] == [] and doc["conversion"] is None


def test_resume_falls_back_past_corrupt_incomplete_unhealthy_and_bad(ms, root, server):
    _job(ms, root, steps=(100, 200, 300, 400, 500))
    save_shard(ms, root, "run1", 0, 600)  # rank 1 never saved step 600
    server.settle()
    # step 500: one shard rots on disk
    victim = root / "run1" / "rank_1" / "net-1_500.ckpt"
    os.chmod(victim, 0o600)
    with open(victim, "r+b") as fh:
        fh.seek(40)
        b = fh.read(1)
        fh.seek(40)
        fh.write(bytes([b[0] ^ 1]))
    admin, reporter = server.client("a-token"), server.client("p-token")
    # bit rot keeps size (and maybe mtime): an on-demand re-verification finds it by digest and CRC
    _wait_job(server, admin.post("/v1/runs/run1/verify", json={"step": 500}).json()["id"])
    server.settle()  # the watcher may have started its own (newer) verification of the same file
    # step 400: training diverged there (NaN loss reported by the trainer)
    assert reporter.post("/v1/runs/run1/health", json={"step": 350, "loss": 2.5}).status_code == 204
    assert reporter.post("/v1/runs/run1/health", content=b'{"step": 390, "loss": NaN}',
                         headers={"content-type": "application/json"}).status_code == 204
    # step 300: an operator marks it bad
    assert admin.post("/v1/runs/run1/steps/300/mark-bad", json={"reason": "data bug"}).status_code == 200
    doc = server.client("r-token").get("/v1/runs/run1/resume").json()
    assert doc["step"] == 200
    assert [(s["step"], s["reason"].split(":")[0]) for s in doc["skipped"]] == [
        (600, "incomplete"), (500, "corrupt"), (400, "unhealthy"), (300, "marked bad by an operator")]
    assert "nan" in doc["skipped"][2]["reason"]
    # "resume at or before N"
    assert server.client("r-token").get("/v1/runs/run1/resume", params={"max_step": 150}).json()["step"] == 100


def test_resume_with_deleted_newest_and_nothing_restorable(ms, root, server):
    _job(ms, root, steps=(100, 200))
    server.settle()
    (root / "run1" / "rank_0" / "net-1_200.ckpt").unlink()
    server.settle()
    c = server.client("r-token")
    doc = c.get("/v1/runs/run1/resume").json()
    assert doc["step"] == 100 and doc["skipped"] == [{"step": 200, "reason": "deleted: a shard file is gone"}]
    r = c.get("/v1/runs/run1/resume", params={"max_step": 50})
    assert r.status_code == 404 and r.json()["detail"]["code"] == "no_restorable_step"
    assert c.get("/v1/runs/nope/resume").status_code == 404


def test_resume_for_another_world_size_says_conversion_needed(ms, root, server):
    _job(ms, root, steps=(100,))
    server.settle()
    doc = server.client("r-token").get("/v1/runs/run1/resume", params={"world_size": 4}).json()
    assert doc["conversion"]["needed"] and doc["conversion"]["to_world_size"] == 4 and doc["conversion"]["existing"] is None


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("post", "/v1/runs/run1/steps/100/mark-bad", {}),
        ("post", "/v1/runs/run1/steps/100/unmark-bad", None),
        ("post", "/v1/runs/run1/steps/100/pin", None),
        ("post", "/v1/runs/run1/steps/100/unpin", None),
        ("post", "/v1/runs/run1/verify", {}),
        ("post", "/v1/runs/run1/gc", {"dry_run": True}),
        ("post", "/v1/runs/run1/health", {"step": 1, "loss": 1.0}),
    ],
)
def test_every_mutation_needs_auth(ms, root, server, method, path, body):
    _job(ms, root, steps=(100,))
    server.settle()
    kwargs = {"json": body} if body is not None else {}
    assert getattr(server.client(), method)(path, **kwargs).status_code == 401
    assert getattr(server.client("wrong"), method)(path, **kwargs).status_code == 401
    assert getattr(server.client("r-token"), method)(path, **kwargs).status_code == 403
    needed = "p-token" if path.endswith("/health") else "a-token"
    if needed == "a-token":
        assert getattr(server.client("p-token"), method)(path, **kwargs).status_code == 403
    assert getattr(server.client(needed), method)(path, **kwargs).status_code < 300
    assert server.client().get("/v1/runs").status_code == 401  # reads need a token too


@pytest.mark.parametrize(
    "path",
    ["/v1/runs/..%2F..%2Fetc/resume", "/v1/runs/%2Fetc%2Fpasswd/steps", "/v1/runs/a%00b/resume",
     "/v1/runs/.hidden/steps", "/v1/runs/run1/steps/..%2F..%2Fetc"],
)
def test_traversal_attempts_are_refused(root, server, path):
    r = server.client("a-token").get(path)
    assert 400 <= r.status_code < 500 and r.status_code != 500


def test_symlinks_out_of_the_root_are_never_catalogued(ms, root, server, tmp_path):
    outside = tmp_path / "outside"
    save_shard(ms, outside, "evil", 0, 100)
    (root / "run2").mkdir()
    os.symlink(outside / "evil" / "rank_0", root / "run2" / "rank_0")  # a rank dir pointing out of the root
    os.symlink(outside / "evil", root / "run3")  # a run dir pointing out of the root
    server.settle()
    paths = [p for (p,) in query(server.app.state.settings.db, "SELECT path FROM shards")]
    assert paths == []


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"step": "x"}', b'{"step": -1, "loss": 1}', b'{"loss": 1}', b'{"step": 1, "extra": 2}', b"[]"],
)
def test_malformed_bodies_get_a_clear_4xx(root, server, body):
    r = server.client("a-token").post("/v1/runs/run1/health", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["code"] == "invalid_request" and r.json()["detail"]["message"]


def test_steps_shards_jobs_metrics_and_openapi(ms, root, server):
    _job(ms, root, steps=(100, 200))
    server.settle()
    c, admin = server.client("r-token"), server.client("a-token")
    steps = c.get("/v1/runs/run1/steps", params={"state": "verified"}).json()
    assert [s["step"] for s in steps] == [200, 100] and all(s["restorable"] for s in steps)
    assert c.get("/v1/runs/run1/steps", params={"state": "bogus"}).status_code == 400
    shards = c.get("/v1/runs/run1/steps/200/shards").json()
    assert [s["state"] for s in shards] == ["verified", "verified"] and shards[0]["crc"] == "valid"
    job = admin.post("/v1/runs/run1/verify", json={"step": 200}).json()
    assert job["kind"] == "verify" and job["total"] == 2
    j = _wait_job(server, job["id"])
    assert j["state"] == "done" and j["done"] == 2 and j["progress"] == 1.0 and j["result"]["shards"] == {"verified": 2}
    metrics = c.get("/metrics").text
    assert 'ckptd_shards{state="verified"} 4' in metrics
    assert 'ckptd_recovery_point_seconds{run="run1"}' in metrics and "ckptd_verified_bytes_total" in metrics
    assert "ckptd_file_events_lost_total 0" in metrics and "ckptd_rescans_total" in metrics
    (rate,) = re.findall(r'^ckptd_verification_bytes_per_second\{node="[^"]+"\} (\S+)$', metrics, re.M)
    assert float(rate) > 0  # this node verified 4 shards
    health = server.client().get("/healthz").json()
    assert health["status"] == "ok" and health["file_events"] == "inotify" and health["file_events_lost"] == 0
    schema = server.client().get("/openapi.json").json()
    resume_schema = schema["components"]["schemas"]["ResumeAnswer"]
    assert {"step", "epoch", "strategy_file", "shards", "skipped"} <= set(resume_schema["required"])


def test_gc_dry_run_then_delete_keeps_the_invariants(ms, root, server):
    _job(ms, root, steps=(100, 200, 300, 400))
    server.settle()
    admin = server.client("a-token")
    admin.post("/v1/runs/run1/steps/100/pin")
    plan = admin.post("/v1/runs/run1/gc", json={"keep_last": 2, "dry_run": True}).json()
    assert plan["runs"][0]["delete"] == [200]
    assert (root / "run1" / "rank_0" / "net-1_200.ckpt").exists()
    done = admin.post("/v1/runs/run1/gc", json={"keep_last": 2, "dry_run": False}).json()
    assert done["deleted_steps"] == 1 and done["deleted_files"] == 2
    assert not (root / "run1" / "rank_0" / "net-1_200.ckpt").exists()
    assert (root / "run1" / "rank_0" / "net-1_100.ckpt").exists()
    server.settle()
    assert sorted(s["step"] for s in server.client("r-token").get("/v1/runs/run1/steps").json()) == [100, 300, 400]


def test_gc_killed_between_phases_is_finished_on_restart(ms, root, catalog_url):
    """What a gc process killed right after its phase-1 commit leaves (the marks, every file still
    there) is finished by the next daemon start. The marks are committed by the phase-1 function
    itself: a SIGKILL from outside cannot be aimed at that instant without a hook in production code."""
    from sqlalchemy.orm import sessionmaker

    from ckptd.catalog.db import make_engine
    from ckptd.policy import RetentionPolicy
    from ckptd.service.retention import GcReport, mark_for_deletion

    _job(ms, root, steps=(100, 200, 300))
    settings = Settings(root=root, db=catalog_url, settle_seconds=0.2)
    with Server(settings) as srv:
        srv.settle()
    engine = make_engine(catalog_url)
    mark_for_deletion(sessionmaker(engine), RetentionPolicy(keep_last=1), GcReport(dry_run=False), run_name="run1")
    engine.dispose()
    states = dict(query(catalog_url, "SELECT step, state FROM checkpoints"))
    assert states == {100: "deleting", 200: "deleting", 300: "verified"}
    assert (root / "run1" / "rank_0" / "net-1_100.ckpt").exists()  # phase 2 never ran
    with Server(settings) as srv:  # the daemon finishes interrupted deletions at start
        srv.settle()
        doc = srv.client().get("/v1/runs/run1/resume").json()
    assert dict(query(catalog_url, "SELECT step, state FROM checkpoints")) == {300: "verified"}
    assert not (root / "run1" / "rank_1" / "net-1_200.ckpt").exists()
    assert doc["step"] == 300


def test_cli_resume_ls_show_gc_verify_config(ms, root, catalog_url):
    _job(ms, root, steps=(100, 200))
    with Server(Settings(root=root, db=catalog_url, settle_seconds=0.2)) as srv:
        srv.settle()

    def ckptd(*args):
        return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True,
                              env=dict(os.environ, CKPTD_DB=catalog_url, CKPTD_ROOT=str(root)))

    r = ckptd("resume", "--run", "run1", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 200
    assert "run1" in ckptd("ls").stdout
    assert "verified" in ckptd("ls", "run1").stdout
    assert ckptd("show", "run1", "200").returncode == 0
    r = ckptd("verify", "--run", "run1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["shards"] == {"verified": 4}
    assert json.loads(r.stdout)["bytes_verified"] > 0 and json.loads(r.stdout)["bytes_per_second"] > 0
    r = ckptd("gc", "--run", "run1", "--keep-last", "1", "--dry-run", "--json")
    assert json.loads(r.stdout)["runs"][0]["delete"] == [100]
    assert ckptd("mark-bad", "--run", "run1", "--step", "200", "--reason", "spike").returncode == 0
    assert json.loads(ckptd("resume", "--run", "run1", "--json").stdout)["step"] == 100
    r = ckptd("resume", "--run", "nope")
    assert r.returncode == 1 and "no run named 'nope'" in r.stderr and "Traceback" not in r.stderr
    assert json.loads(ckptd("config", "show").stdout)["root"] == str(root)
    r = ckptd("serve", "--host", "0.0.0.0", "--root", str(root))
    assert r.returncode != 0 and "refusing to listen on 0.0.0.0 without authentication" in r.stderr


def test_resume_answer_matches_its_documented_schema(ms, root, server):
    from ckptd.api.schemas import ResumeAnswer

    _job(ms, root, steps=(100,))
    server.settle()
    doc = server.client("r-token").get("/v1/runs/run1/resume", params={"world_size": 4}).json()
    assert ResumeAnswer.model_validate(doc).model_dump(mode="json") == doc  # the fast path skips validation


def test_cached_resume_answers_follow_every_catalog_change(ms, root, server):
    _job(ms, root, steps=(100, 200))
    server.settle()
    reader, admin, reporter = server.client("r-token"), server.client("a-token"), server.client("p-token")
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 200
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 200  # served from the cache
    admin.post("/v1/runs/run1/steps/200/mark-bad", json={"reason": "x"})
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 100
    admin.post("/v1/runs/run1/steps/200/unmark-bad")
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 200
    reporter.post("/v1/runs/run1/health", content=b'{"step": 150, "loss": Infinity}', headers={"content-type": "application/json"})
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 100
    (root / "run1" / "rank_1" / "net-1_100.ckpt").unlink()  # rotation removes the only healthy step
    server.settle()
    r = reader.get("/v1/runs/run1/resume")
    assert r.status_code == 404 and r.json()["detail"]["code"] == "no_restorable_step"
    assert server.app.state.resume_cache.hits >= 1


def test_cached_answer_never_survives_a_change_with_an_older_timestamp(ms, root, server):
    # updated_at is stamped in Python before commit; a change can land with an older stamp than
    # one already seen (the demo hit this). The cache must key on content, not on timestamps.
    from sqlalchemy import create_engine, text

    _job(ms, root, steps=(100, 200))
    server.settle()
    reader = server.client("r-token")
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 200
    engine = create_engine(server.app.state.settings.db.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        conn.execute(text("UPDATE checkpoints SET state = 'corrupt', reason = 'late', updated_at = :old WHERE step = 200"),
                     {"old": "2000-01-01 00:00:00"})
    engine.dispose()
    doc = reader.get("/v1/runs/run1/resume").json()
    assert doc["step"] == 100 and doc["skipped"] == [{"step": 200, "reason": "corrupt: late"}]


# --- the cache's invalidation paths: any writer (another daemon, the CLI, an operator's SQL) -----

@pytest.fixture
def quiet_server(root, catalog_url):
    """A server whose watcher only rescans when told: catalog edits below stay as written."""
    settings = Settings(root=root, db=catalog_url, settle_seconds=0.2, rescan_interval=3600, tokens=TOKENS)
    with Server(settings) as srv:
        yield srv


def _sql(server, *statements):
    """Statements in one transaction on a connection of its own (as another process would write)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(server.app.state.settings.db.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))
    engine.dispose()


_CKPT_200 = "(SELECT id FROM checkpoints WHERE step = 200 AND kind = 'trained')"


@pytest.mark.parametrize(
    "params, statements, expect",
    [
        pytest.param({}, [f"UPDATE shards SET path = path || '.moved' WHERE rank = 1 AND checkpoint_id = {_CKPT_200}"],
                     lambda doc: doc["step"] == 200 and doc["shards"][1]["path"].endswith(".moved"), id="shard-path"),
        pytest.param({}, [f"UPDATE shards SET state = 'corrupt' WHERE rank = 1 AND checkpoint_id = {_CKPT_200}"],
                     lambda doc: doc["step"] == 200 and [s["rank"] for s in doc["shards"]] == [0], id="shard-leaves-verified"),
        pytest.param({}, ["UPDATE strategy_files SET path = path || '.old'"],
                     lambda doc: doc["strategy_file"].endswith(".old"), id="strategy-path"),
        pytest.param({}, ["UPDATE checkpoints SET global_step = 12345 WHERE step = 200"],
                     lambda doc: doc["step"] == 12345, id="global-step"),
        pytest.param({}, [("INSERT INTO step_health (run_id, step, loss_nonfinite, overflow, reported_at) "
                           "SELECT id, 150, 'nan', FALSE, CURRENT_TIMESTAMP FROM runs")],
                     lambda doc: doc["step"] == 100, id="nonfinite-loss"),
        pytest.param({"world_size": 4},
                     [("INSERT INTO checkpoints (run_id, prefix, epoch, step, kind, layout, state, expected_ranks, "
                       "derived_from_id, pinned, marked_bad, created_at, updated_at) SELECT run_id, prefix, epoch, step, "
                       "'converted', 'tp4', 'verified', 4, id, FALSE, FALSE, created_at, updated_at FROM checkpoints "
                       "WHERE step = 200")],
                     lambda doc: doc["conversion"]["existing"] is not None, id="converted-copy"),
        pytest.param({}, ["UPDATE checkpoints SET marked_bad = TRUE WHERE step = 200",  # one transaction, two rows
                          "UPDATE checkpoints SET marked_bad = TRUE WHERE step = 100"],
                     lambda doc: doc["detail"]["code"] == "no_restorable_step", id="two-rows-one-transaction"),
    ],
)
def test_cached_answer_follows_direct_catalog_writes(ms, root, quiet_server, params, statements, expect):
    _job(ms, root, steps=(100, 200))
    quiet_server.settle()
    reader, cache = quiet_server.client("r-token"), quiet_server.app.state.resume_cache
    before = reader.get("/v1/runs/run1/resume", params=params).json()
    hits = cache.hits
    assert reader.get("/v1/runs/run1/resume", params=params).json() == before and cache.hits == hits + 1
    _sql(quiet_server, *statements)
    after = reader.get("/v1/runs/run1/resume", params=params).json()
    assert after != before and expect(after), after


def test_lease_renewals_keep_the_cached_answer(ms, root, quiet_server):
    _job(ms, root, steps=(100, 200))
    quiet_server.settle()
    reader, cache = quiet_server.client("r-token"), quiet_server.app.state.resume_cache
    first = reader.get("/v1/runs/run1/resume").content  # computes the answer and leases step 200
    leases = query(quiet_server.app.state.settings.db, "SELECT lease_until FROM checkpoints WHERE step = 200")
    assert leases[0][0] is not None
    hits = cache.hits
    _sql(quiet_server, "UPDATE checkpoints SET lease_until = NULL, updated_at = CURRENT_TIMESTAMP")
    assert reader.get("/v1/runs/run1/resume").content == first and cache.hits == hits + 1


def test_fast_path_serves_the_routes_bytes_and_leaves_errors_to_it(ms, root, quiet_server):
    _job(ms, root, steps=(100, 200))
    quiet_server.settle()
    reader, cache = quiet_server.client("r-token"), quiet_server.app.state.resume_cache
    for params in ({}, {"max_step": "150"}, {"world_size": "4", "lease": "false"}):
        computed = reader.get("/v1/runs/run1/resume", params=params)
        hits = cache.hits
        cached = reader.get("/v1/runs/run1/resume", params=params)
        assert cache.hits == hits + 1
        assert (cached.status_code, cached.content) == (computed.status_code, computed.content) == (200, computed.content)
        assert cached.headers["content-type"] == computed.headers["content-type"] == "application/json"
    # forms the fast path does not take go to the route, which parses them its own way
    assert reader.get("/v1/runs/run1/resume", params={"max_step": "0150"}).json()["step"] == 100
    assert reader.get("/v1/runs/run1/resume", params={"max_step": "-1"}).status_code == 422
    assert reader.get("/v1/runs/run1/resume", params={"lease": "maybe"}).status_code == 422
    # a warm cache never answers without a valid token
    assert quiet_server.client().get("/v1/runs/run1/resume").status_code == 401
    assert quiet_server.client("wrong").get("/v1/runs/run1/resume").status_code == 401
    assert quiet_server.client("p-token").get("/v1/runs/run1/resume").status_code == 200


def test_a_storm_after_a_change_gets_only_the_new_answer(ms, root, quiet_server):
    from concurrent.futures import ThreadPoolExecutor

    _job(ms, root, steps=(100, 200))
    quiet_server.settle()
    cache = quiet_server.app.state.resume_cache

    def storm() -> set[int]:
        def one(_: int) -> int:
            with quiet_server.client("r-token") as c:
                return c.get("/v1/runs/run1/resume").json()["step"]

        with ThreadPoolExecutor(16) as pool:
            return set(pool.map(one, range(32)))

    assert storm() == {200}
    _sql(quiet_server, "UPDATE checkpoints SET marked_bad = TRUE WHERE step = 200")
    misses = cache.misses
    assert storm() == {100}
    assert cache.misses == misses + 1  # one computation for the whole storm; the others were served from it


def test_resume_generation_triggers_exist_at_head(catalog_url):
    # A later migration that makes SQLite rebuild one of these tables (batch "move and copy")
    # drops its triggers silently, and cached resume answers would go stale: it must recreate them.
    sql = ("SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND name LIKE 'ckptd_resume_gen_%'"
           if catalog_url.startswith("sqlite") else
           "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'ckptd_resume_gen_%' AND NOT tgisinternal")
    assert query(catalog_url, sql) == [(14,)]  # 11 of 0002 and 3 of 0008 (shard_copies)
