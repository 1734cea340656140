"""``/metrics`` of a real ``ckptd serve`` (issue 24), read with prometheus_client's own parser.

One server per catalog for the whole module (``served``): a run that saved three steps — the last
one torn (rank 1 never wrote it) — and a run with one larger step to convert, written with real
MindSpore before the server starts, plus a second node whose heartbeat stopped an hour ago. The
server runs under :mod:`tests.slow_convert` (``report``): a conversion holds at its first progress
report until its job is cancelled, so its progress gauge is read while it runs, without a timing
guess. Everything else is ``ckptd serve`` as deployed.

No timing thresholds: every latency is checked against what the test itself observed around it
(an answer cannot take longer on the server than the request took at the client; a file cannot
wait longer for its verdict than the time since the test wrote it).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api_helpers import free_port, stop_process
from tests.conftest import fresh_pg_database
from tests.daemon_helpers import migrated_sqlite, save_shard, wait_for, write_tp_strategy

REPO = Path(__file__).resolve().parent.parent
READ, ADMIN = "metrics-read-token", "metrics-admin-token"
NODE, GONE = "node-metrics", "node-gone"

#: every series name /metrics had before prometheus_client (tests, bench and dashboards read them)
EXISTING = ("ckptd_shards", "ckptd_shards_verified_total", "ckptd_verification_failures_total",
            "ckptd_verified_bytes_total", "ckptd_rescans_total", "ckptd_file_events_lost_total",
            "ckptd_verification_seconds_total", "ckptd_verification_bytes_per_second", "ckptd_conversion_bytes_total",
            "ckptd_conversion_seconds_total", "ckptd_conversion_bytes_per_second", "ckptd_recovery_point_seconds",
            "ckptd_node_shards", "ckptd_node_heartbeat_age_seconds", "ckptd_node_reachable", "ckptd_up_seconds")
#: the labels ckptd may put on a series: never a step, a shard or a file
BOUNDED_LABELS = {"state", "node", "run", "job", "path", "code", "le"}


def _register_gone_node(url: str) -> None:
    """A node that registered once and then fell silent an hour ago (its daemon died)."""
    from ckptd.catalog import nodes
    from ckptd.catalog.db import make_engine
    from ckptd.catalog.models import Node

    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            from sqlalchemy.orm import Session

            with Session(bind=conn) as s:
                nodes.register(s, GONE, "/elsewhere")
                s.query(Node).filter(Node.name == GONE).update(
                    {"heartbeat_at": datetime.now(timezone.utc) - timedelta(hours=1)})
                s.flush()
    finally:
        engine.dispose()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(request, ms, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"metrics-{request.param}")
    root = tmp / "root"
    root.mkdir()
    if request.param == "sqlite":
        url, drop = migrated_sqlite(tmp / "catalog.db"), (lambda: None)
    else:
        from ckptd.catalog.db import make_engine, upgrade

        url, drop = fresh_pg_database()
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
    written_at = time.time()
    write_tp_strategy(root / "run1")
    for step in (100, 200):
        for rank in range(2):
            save_shard(ms, root, "run1", rank, step)
    write_tp_strategy(root / "big")
    for rank in range(2):  # 8 MiB per rank: its conversion writes in several progress reports
        w = np.arange(1024 * 2048, dtype=np.float32).reshape(1024, 2048) + rank
        save_shard(ms, root, "big", rank, 100, tensors={"w": w, "b": np.full(3, 1.0, np.float32)})
    _register_gone_node(url)

    tokens = tmp / "tokens"
    tokens.write_text(f"read {READ}\nadmin {ADMIN}\n")
    marker = tmp / "held"
    port = free_port()
    log = tmp / "serve.log"
    env = dict(os.environ, CKPTD_SETTLE_SECONDS="0.2", CKPTD_RESCAN_INTERVAL="30", PYTHONPATH=str(REPO),
               CKPTD_TOKEN_FILE=str(tokens), CKPTD_NODE_NAME=NODE, CKPTD_TEST_SLOW_MARKER=str(marker))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.slow_convert", "report", "--", "serve", "--root",
                                 str(root), "--port", str(port), "--db", url], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    read = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {READ}"}, timeout=30)
    admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)

    def settled() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"ckptd serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            runs = {r["name"]: r for r in read.get("/v1/runs").json()}
        except (httpx.HTTPError, ValueError):
            return False
        return (set(runs) == {"run1", "big"} and runs["run1"]["latest_restorable_step"] == 200
                and runs["big"]["latest_restorable_step"] == 100
                and _samples(read).get("ckptd_shards", {}).get((("state", "verified"),)) == shards)

    try:
        shards = 6
        wait_for(settled, timeout=120, interval=0.2, what="both runs catalogued and every shard verified")
        # a save while the daemon runs (its latency runs from the file's mtime): torn, rank 1 never saves step 300
        save_shard(ms, root, "run1", 0, 300)
        shards = 7
        wait_for(settled, timeout=60, interval=0.2, what="step 300's shard verified")
        files = sorted(p for p in root.rglob("*.ckpt") if p.parent.name.startswith("rank_"))
        yield SimpleNamespace(read=read, admin=admin, root=root, marker=marker, files=files, written_at=written_at,
                              log=log)
    finally:
        read.close()
        admin.close()
        stop_process(proc)
        drop()


def _families(client: httpx.Client) -> dict:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _samples(client: httpx.Client) -> dict[str, dict[tuple, float]]:
    """sample name -> {sorted label items: value}, as prometheus_client's parser reads the page."""
    out: dict[str, dict[tuple, float]] = {}
    for family in _families(client).values():
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_every_existing_series_is_still_exported_with_its_help(served):
    families = _families(served.read)
    samples = {s.name for f in families.values() for s in f.samples}
    assert set(EXISTING) <= samples, sorted(set(EXISTING) - samples)
    for family in families.values():
        assert family.documentation.strip() and family.type in ("counter", "gauge", "histogram"), family
    values = _samples(served.read)
    # seven shard files, all verified by this node, and their bytes are exactly the files' sizes
    assert values["ckptd_shards"] == {(("state", "verified"),): 7}
    assert values["ckptd_node_shards"] == {(("node", NODE), ("state", "verified")): 7}
    assert values["ckptd_shards_verified_total"][()] == 7 and values["ckptd_verification_failures_total"][()] == 0
    assert values["ckptd_verified_bytes_total"][()] == sum(p.stat().st_size for p in served.files)
    (rate,) = values["ckptd_verification_bytes_per_second"].items()
    assert rate[0] == (("node", NODE),) and rate[1] > 0
    assert values["ckptd_up_seconds"][()] > 0


def test_metrics_keep_the_read_scope(served):
    anonymous = httpx.get(str(served.read.base_url.join("/metrics")), timeout=30)
    assert anonymous.status_code == 401 and anonymous.json()["detail"]["code"] == "unauthorized", anonymous.text


def test_rename_to_verified_latency_counts_each_new_shard_once(served):
    before_scrape = time.time()
    values = _samples(served.read)
    count = values["ckptd_rename_to_verified_seconds_count"][()]
    assert count == len(served.files) == 7  # every file's first verdict, none twice
    buckets = sorted(((float(dict(k)["le"]), v) for k, v in values["ckptd_rename_to_verified_seconds_bucket"].items()))
    assert buckets[-1] == (math.inf, count)
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets  # cumulative
    # no file waited for its verdict longer than since the test began writing it
    waited = before_scrape - served.written_at
    assert 0 < values["ckptd_rename_to_verified_seconds_sum"][()] <= count * waited
    assert all(v == count for le, v in buckets if le >= waited), (waited, buckets)


def test_recovery_point_per_run_in_seconds_and_steps(served):
    before_scrape = time.time()
    values = _samples(served.read)
    # run1's newest save (300, torn) is 100 steps past its newest restorable one (200); big is up to date
    assert values["ckptd_recovery_point_steps"] == {(("run", "run1"),): 100, (("run", "big"),): 0}
    seconds = values["ckptd_recovery_point_seconds"]
    assert set(seconds) == {(("run", "run1"),), (("run", "big"),)}
    assert all(0 <= v <= before_scrape - served.written_at for v in seconds.values()), seconds
    # a launcher's resume lease touches the step's row: the age of the recovery point goes on growing
    assert served.read.get("/v1/runs/run1/resume").status_code == 200
    after = _samples(served.read)["ckptd_recovery_point_seconds"][(("run", "run1"),)]
    assert after >= seconds[(("run", "run1"),)], (after, seconds)


def test_node_liveness_one_alive_zero_unreachable(served):
    values = _samples(served.read)
    assert values["ckptd_node_reachable"] == {(("node", NODE),): 1, (("node", GONE),): 0}
    ages = values["ckptd_node_heartbeat_age_seconds"]
    assert ages[(("node", GONE),)] >= 3600 > ages[(("node", NODE),)]


def _resume_histogram(client: httpx.Client) -> dict[tuple[str, str], tuple[float, float]]:
    """(path, code) -> (count, sum) of ckptd_resume_answer_seconds."""
    values = _samples(client)
    out = {}
    for labels, n in values.get("ckptd_resume_answer_seconds_count", {}).items():
        key = (dict(labels)["path"], dict(labels)["code"])
        out[key] = (n, values["ckptd_resume_answer_seconds_sum"][labels])
    return out


def test_resume_answer_latency_by_path_and_code(served):
    before = _resume_histogram(served.read)
    spent = 0.0
    codes = []

    def ask(client: httpx.Client, run: str) -> int:
        nonlocal spent
        t0 = time.perf_counter()
        r = client.get(f"/v1/runs/{run}/resume", params={"lease": "false"})
        spent += time.perf_counter() - t0
        codes.append(r.status_code)
        return r.status_code

    assert ask(served.read, "run1") == 200
    # the same question again until the cached answer is served before the API stack (the first
    # after a change is computed by the route)
    wait_for(lambda: ask(served.read, "run1") == 200 and _resume_histogram(served.read).get(("cache", "200"), (0, 0))[0]
             > before.get(("cache", "200"), (0, 0))[0], timeout=30, what="a cached resume answer")
    assert ask(served.read, "no-such-run") == 404
    with httpx.Client(base_url=served.read.base_url, timeout=30) as anonymous:
        assert ask(anonymous, "run1") == 401
    after = _resume_histogram(served.read)
    delta = {k: (after[k][0] - before.get(k, (0, 0))[0], after[k][1] - before.get(k, (0, 0))[1]) for k in after}
    delta = {k: v for k, v in delta.items() if v[0]}
    assert set(delta) <= {("cache", "200"), ("route", "200"), ("route", "404"), ("route", "401")}, delta
    assert {("cache", "200"), ("route", "404"), ("route", "401")} <= set(delta), delta
    assert sum(n for n, _ in delta.values()) == len(codes)  # every answer observed once
    assert 0 < sum(s for _, s in delta.values()) <= spent  # the server never took longer than the client waited


def test_conversion_progress_only_while_the_job_runs(served):
    assert _samples(served.read).get("ckptd_conversion_progress", {}) == {}
    r = served.admin.post("/v1/runs/big/conversions", json={"step": 100, "to_strategy": "none"})
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    wait_for(served.marker.exists, timeout=120, what="the conversion held mid-way")
    assert served.read.get(f"/v1/jobs/{job}").json()["state"] == "running"
    ((labels, progress),) = _samples(served.read)["ckptd_conversion_progress"].items()
    assert dict(labels) == {"run": "big", "job": str(job)}
    assert progress == served.read.get(f"/v1/jobs/{job}").json()["progress"] and 0 < progress < 1
    assert served.admin.post(f"/v1/jobs/{job}/cancel").status_code == 202
    wait_for(lambda: served.read.get(f"/v1/jobs/{job}").json()["state"] == "failed", timeout=60,
             what="the cancelled conversion to end")
    assert _samples(served.read).get("ckptd_conversion_progress", {}) == {}


def test_labels_stay_bounded(served):
    for family in _families(served.read).values():
        for s in family.samples:
            assert set(s.labels) <= BOUNDED_LABELS, (s.name, s.labels)
            if "run" in s.labels:
                assert s.labels["run"] in ("run1", "big"), s


# --- the Grafana dashboard --------------------------------------------------------------------------


def _exported_series(families: dict) -> set[str]:
    """Every series name the page declares (a family without samples still has HELP and TYPE)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {family.name + suffix for family in families.values() for suffix in suffixes[family.type]}


def test_every_dashboard_query_names_a_series_ckptd_exports(served):
    dashboard = json.loads((REPO / "docker" / "grafana" / "ckptd.json").read_text())
    exported = _exported_series(_families(served.read))
    panels = [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]]
    exprs = [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
    assert len(exprs) >= 8, exprs
    exprs += [(v["name"], v["definition"]) for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for title, expr in exprs:
        named = set(re.findall(r"\bckptd_[a-zA-Z0-9_]+", expr))
        assert named, (title, expr)
        assert named <= exported, (title, sorted(named - exported))
    queried = {name for _, expr in exprs for name in re.findall(r"\bckptd_[a-zA-Z0-9_]+", expr)}
    # a panel for every series the issue asked for
    for wanted in ("ckptd_rename_to_verified_seconds_bucket", "ckptd_recovery_point_seconds",
                   "ckptd_recovery_point_steps", "ckptd_verified_bytes_total", "ckptd_conversion_progress",
                   "ckptd_node_reachable", "ckptd_resume_answer_seconds_bucket"):
        assert wanted in queried, wanted


def test_compose_provisions_prometheus_and_grafana_with_the_dashboard():
    import yaml

    docker = REPO / "docker"
    compose = yaml.safe_load((docker / "compose.yaml").read_text())
    services = compose["services"]
    # Prometheus scrapes the ckptd service's port with a token of the read scope
    scrape = yaml.safe_load((docker / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    (job,) = [j for j in scrape if j["job_name"] == "ckptd"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"ckptd:{services['ckptd']['ports'][0].split(':')[-1]}"]
    secret = job["authorization"]["credentials_file"].removeprefix("/run/secrets/")
    assert secret in services["prometheus"]["secrets"]
    token = (docker / compose["secrets"][secret]["file"]).read_text().strip()
    scopes = dict(reversed(line.split()) for line in (docker / compose["secrets"]["ckptd_tokens"]["file"]).read_text()
                  .splitlines() if line.strip() and not line.startswith("#"))
    assert scopes[token] == "read"
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    # Grafana: the datasource the dashboard names, and the dashboard where the provider looks
    datasource = yaml.safe_load((docker / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (ds,) = datasource["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((docker / "grafana" / "provisioning" / "dashboards" / "ckptd.yaml").read_text())
    mounts = dict(v.removesuffix(":ro").split(":", 1) for v in services["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./grafana/ckptd.json"] == f"{provider['providers'][0]['options']['path']}/ckptd.json"
    dashboard = json.loads((docker / "grafana" / "ckptd.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {ds["uid"]}
