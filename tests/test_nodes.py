"""Several daemons, one PostgreSQL catalog: node ownership, shared work, and no false deletes.

Real processes: each ``ckptd serve`` runs in its own mount namespace (``unshare -m``) where its
node's directory is bind-mounted at the same path — exactly the README's deployment, one daemon
per training node, each node's local disk at ``/checkpoints``. And two daemons on one shared
directory (Lustre/NFS) splitting the verification work.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ckptd.catalog.db import make_engine, upgrade
from tests.api_helpers import free_port, stop_process
from tests.daemon_helpers import query, rank_tensors, save_shard, wait_for, write_tp_strategy

TP = 4
ADMIN = "node-test-admin"
pytestmark = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                reason="needs root and unshare(1) for mount namespaces")


@pytest.fixture
def pg_url():
    from tests.conftest import _fresh_pg_database

    url, drop = _fresh_pg_database()
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    drop()


class Node:
    """``ckptd serve`` as node ``name``: ``disk`` is bind-mounted at ``mount`` in its own namespace."""

    def __init__(self, name: str, disk: Path, mount: Path, url: str, log: Path) -> None:
        self.name, self.disk, self.mount, self.url, self.log = name, disk, mount, url, log
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Node":
        env = dict(os.environ, CKPTD_NODE_NAME=self.name, CKPTD_NODE_TIMEOUT="3", CKPTD_HEARTBEAT_INTERVAL="0.5",
                   CKPTD_RESCAN_INTERVAL="1", CKPTD_SETTLE_SECONDS="0.2", CKPTD_TOKENS=f'{{"{ADMIN}": "admin"}}')
        serve = [sys.executable, "-m", "ckptd", "serve", "--root", str(self.mount), "--db", self.url, "--port", str(self.port)]
        if self.disk != self.mount:  # node-local disk at the shared path, visible to this process only
            cmd = ["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                   'mount --bind "$0" "$1" && shift && exec "$@"', str(self.disk), str(self.mount), *serve]
        else:
            cmd = serve
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        wait_for(self._up, 60, 0.2, f"node {self.name} up")
        return self

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"node {self.name} exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            return bool(self.get("/healthz").json().get("first_rescan_done"))
        except httpx.HTTPError:
            return False

    def get(self, path: str, **params) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.port}{path}", params=params, timeout=10,
                         headers={"Authorization": f"Bearer {ADMIN}"})

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{self.port}{path}", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {ADMIN}"})

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        stop_process(self.proc)


def _save(ms, disk: Path, ranks, step: int) -> None:
    if not (disk / "run" / "strategy.ckpt").exists():
        write_tp_strategy(disk / "run", tp=TP)  # every node's job writes the (same) strategy file
    for r in ranks:
        save_shard(ms, disk, "run", r, step, tensors=rank_tensors(r, step, tp=TP))


def _states(url: str) -> dict[int, str]:
    return dict(query(url, "SELECT step, state FROM checkpoints WHERE kind = 'trained'"))


def test_a_step_split_across_two_nodes_is_restorable_and_ownership_holds(ms, tmp_path, pg_url):
    mount = tmp_path / "checkpoints"
    mount.mkdir()
    disk_a, disk_b = tmp_path / "disk_a", tmp_path / "disk_b"
    for step in (10, 20):
        _save(ms, disk_a, (0, 1), step)
        _save(ms, disk_b, (2, 3), step)
    a = Node("node-a", disk_a, mount, pg_url, tmp_path / "a.log")
    b = Node("node-b", disk_b, mount, pg_url, tmp_path / "b.log")
    try:
        a.start(), b.start()
        wait_for(lambda: _states(pg_url) == {10: "verified", 20: "verified"}, 60, 0.2, "both steps verified")
        answer = a.get("/v1/runs/run/resume", lease="false").json()
        assert answer["step"] == 20 and answer["unreachable_nodes"] == []
        assert {e["rank"]: e["node"] for e in answer["shards"]} == {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
        # several rescans of each daemon: nobody marks the other node's files deleted (the bug: they flapped)
        time.sleep(3.5)
        assert _states(pg_url) == {10: "verified", 20: "verified"}
        assert query(pg_url, "SELECT count(*) FROM verification_events WHERE outcome = 'deleted'") == [(0,)]
        assert query(pg_url, "SELECT count(*) FROM shards WHERE state <> 'verified'") == [(0,)]
        per_shard = query(pg_url, "SELECT shard_id, count(*) FROM verification_events WHERE kind = 'shard' "
                                  "GROUP BY shard_id")
        assert len(per_shard) == 8 and {n for _, n in per_shard} == {1}  # each shard verified once, by its node
        nodes = {n["name"]: n for n in a.get("/v1/nodes").json()}
        assert nodes["node-a"]["reachable"] and nodes["node-b"]["reachable"]
        metrics = a.get("/metrics").text
        assert 'ckptd_node_shards{node="node-b",state="verified"} 4' in metrics
        assert 'ckptd_node_heartbeat_age_seconds{node="node-a"}' in metrics

        b.kill()  # node B's daemon dies with its node
        wait_for(lambda: not {n["name"]: n for n in a.get("/v1/nodes").json()}["node-b"]["reachable"], 30, 0.2,
                 "node-b unreachable")
        time.sleep(2.5)  # rescans of node A meanwhile
        assert _states(pg_url) == {10: "verified", 20: "verified"}  # unreachable, not deleted
        answer = a.get("/v1/runs/run/resume", lease="false").json()
        assert answer["step"] == 20 and answer["unreachable_nodes"] == ["node-b"]
        refused = a.get("/v1/runs/run/resume", lease="false", exclude_unreachable="true")
        assert refused.status_code == 404
        assert "node-b" in refused.json()["detail"]["skipped"][0]["reason"]

        # node B comes back after its file of step 20, rank 3, was really lost on its disk
        lost = disk_b / "run" / "rank_3" / "net-1_20.ckpt"
        os.chmod(lost, 0o600)
        os.remove(lost)
        b.start()
        wait_for(lambda: _states(pg_url).get(20) == "deleted", 30, 0.2, "step 20 deleted within a rescan")
        assert _states(pg_url)[10] == "verified"
        answer = a.get("/v1/runs/run/resume", lease="false").json()
        assert answer["step"] == 10 and answer["unreachable_nodes"] == []

        # retention started on node A: each node deletes its own files, the last one removes the rows
        _save(ms, disk_a, (0, 1), 30)
        _save(ms, disk_b, (2, 3), 30)
        wait_for(lambda: _states(pg_url).get(30) == "verified", 60, 0.2, "step 30 verified")
        report = a.post("/v1/runs/run/gc", {"keep_last": 1, "dry_run": False})
        assert report.status_code == 200, report.text
        wait_for(lambda: set(_states(pg_url)) == {30}, 30, 0.2, "steps 10 and 20 gone from the catalog")
        for disk, ranks in ((disk_a, (0, 1)), (disk_b, (2, 3))):
            for r in ranks:
                assert not (disk / "run" / f"rank_{r}" / "net-1_10.ckpt").exists()
                assert (disk / "run" / f"rank_{r}" / "net-1_30.ckpt").exists()
    finally:
        a.stop()
        b.stop()


def test_two_daemons_on_one_shared_directory_split_the_work(ms, tmp_path, pg_url):
    shared = tmp_path / "lustre"
    shared.mkdir()
    a = Node("node-a", shared, shared, pg_url, tmp_path / "a.log")
    b = Node("node-b", shared, shared, pg_url, tmp_path / "b.log")
    try:
        a.start(), b.start()
        steps = list(range(10, 130, 10))
        for step in steps:
            _save(ms, shared, range(TP), step)
        wait_for(lambda: len(_states(pg_url)) == len(steps) and set(_states(pg_url).values()) == {"verified"},
                 90, 0.2, "all steps verified")
        per_shard = query(pg_url, "SELECT shard_id, count(*) FROM verification_events WHERE kind = 'shard' "
                                  "GROUP BY shard_id")
        assert len(per_shard) == TP * len(steps) and {n for _, n in per_shard} == {1}  # never verified twice
        assert query(pg_url, "SELECT count(*), count(DISTINCT path) FROM shards")[0] == (TP * len(steps),) * 2
        # a daemon dies: its share of new work is taken over by the other, nothing it owned is deleted
        a.kill()
        _save(ms, shared, range(TP), 200)
        wait_for(lambda: _states(pg_url).get(200) == "verified", 60, 0.2, "step 200 verified by node-b alone")
        # past node-a's timeout (3 s) node-b takes over the files it sees, at its next rescans
        total = TP * (len(steps) + 1)
        wait_for(lambda: dict(query(pg_url, "SELECT node, count(*) FROM shards GROUP BY node")).get("node-b") == total,
                 30, 0.2, "node-b owns every shard")
        assert set(_states(pg_url).values()) == {"verified"}
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_catalog_from_before_nodes_upgrades_and_its_rows_are_claimed_by_the_first_rescan(ms, tmp_path, backend):
    """Rows catalogued before migration 0006 have no node: the daemon whose rescan sees the files
    claims them; until then they keep their verdicts (nothing is marked deleted)."""
    from ckptd.daemon import Daemon
    from ckptd.settings import Settings
    from tests.conftest import _fresh_pg_database

    url, drop = (f"sqlite:///{tmp_path / 'old.db'}", lambda: None) if backend == "sqlite" else _fresh_pg_database()
    try:
        root = tmp_path / "root"
        for r in range(TP):
            _save(ms, root, (r,), 10)
        engine = make_engine(url)
        upgrade(engine, "0005")  # a catalog as the previous release left it
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO runs (id, name, path, created_at) VALUES (1, 'run', '%s', CURRENT_TIMESTAMP)" % (root / "run"))
            conn.exec_driver_sql(
                "INSERT INTO checkpoints (id, run_id, prefix, epoch, step, kind, layout, state, expected_ranks, pinned, "
                "marked_bad, created_at, updated_at) VALUES (1, 1, 'net', 1, 10, 'trained', '', 'verified', 4, false, "
                "false, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)")
            for r in range(TP):
                p = root / "run" / f"rank_{r}" / "net-1_10.ckpt"
                st = p.stat()
                conn.exec_driver_sql(
                    "INSERT INTO shards (checkpoint_id, rank, path, size, mtime_ns, inode, state, quarantined, verify_seq, "
                    f"seen_at) VALUES (1, {r}, '{p}', {st.st_size}, {st.st_mtime_ns}, {st.st_ino}, 'verified', false, 0, "
                    "CURRENT_TIMESTAMP)")
        upgrade(engine)
        engine.dispose()
        assert query(url, "SELECT DISTINCT node FROM shards") == [(None,)]  # the documented placeholder
        d = Daemon(Settings(root=root, db=url, node_name="node-a", settle_seconds=0.2, rescan_interval=0.5, debounce=0.02))
        d.start()
        try:
            wait_for(lambda: query(url, "SELECT DISTINCT node FROM shards") == [("node-a",)], 30, 0.1, "rows claimed")
            assert query(url, "SELECT DISTINCT state FROM shards") == [("verified",)]
        finally:
            d.stop()
    finally:
        drop()
