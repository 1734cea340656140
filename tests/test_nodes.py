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
from pathlib import Path

import httpx
import pytest

from ckptd.catalog.db import make_engine, upgrade
from ckptd.states import ShardState
from tests.api_helpers import free_port, stop_process
from tests.daemon_helpers import (
    query, rank_tensors, save_shard, started_daemon, wait_for, wait_for_rescans, write_tp_strategy,
)

TP = 4
ADMIN = "node-test-admin"
pytestmark = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                reason="needs root and unshare(1) for mount namespaces")


@pytest.fixture
def pg_url():
    from tests.conftest import fresh_pg_database

    url, drop = fresh_pg_database()
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    drop()


class Node:
    """``ckptd serve`` as node ``name``: ``disk`` is bind-mounted at ``mount`` in its own namespace."""

    def __init__(self, name: str, disk: Path, mount: Path, url: str, log: Path, timeout: float = 6, **env: str) -> None:
        self.name, self.disk, self.mount, self.url, self.log = name, disk, mount, url, log
        self.timeout, self.env = timeout, env
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Node":
        env = dict(os.environ, CKPTD_NODE_NAME=self.name, CKPTD_NODE_TIMEOUT=str(self.timeout), CKPTD_HEARTBEAT_INTERVAL="0.5",
                   CKPTD_RESCAN_INTERVAL="1", CKPTD_SETTLE_SECONDS="0.2", CKPTD_TOKENS=f'{{"{ADMIN}": "admin"}}',
                   **self.env)
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

    def job(self, path: str, body: dict) -> dict:
        """Start a job (``POST path``) and wait for its end."""
        started = self.post(path, body)
        assert started.status_code == 202, started.text
        job_id = started.json()["id"]
        wait_for(lambda: self.get(f"/v1/jobs/{job_id}").json()["state"] in ("done", "failed"), 120, 0.2, f"job {job_id}")
        return self.get(f"/v1/jobs/{job_id}").json()

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
        for node in (a, b):
            wait_for_rescans(lambda: node.get("/healthz").json()["rescans"], 3)
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
        wait_for_rescans(lambda: a.get("/healthz").json()["rescans"])  # a whole rescan of node A meanwhile
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


def test_scrub_on_both_nodes_judges_only_each_nodes_own_files(ms, tmp_path, pg_url):
    """Both daemons scrub (re-read every verified shard every second): neither judges the other's
    node-local files (the scrub had the rescans' blind spot), and bit rot on node B — content
    changed, size and mtime kept, so only a re-read can see it — is found by B's scrub."""
    mount = tmp_path / "checkpoints"
    mount.mkdir()
    disk_a, disk_b = tmp_path / "disk_a", tmp_path / "disk_b"
    _save(ms, disk_a, (0, 1), 10)
    _save(ms, disk_b, (2, 3), 10)
    a = Node("node-a", disk_a, mount, pg_url, tmp_path / "a.log", CKPTD_SCRUB_INTERVAL="1")
    b = Node("node-b", disk_b, mount, pg_url, tmp_path / "b.log", CKPTD_SCRUB_INTERVAL="1")
    per_shard = "SELECT shard_id, count(*) FROM verification_events WHERE kind = 'shard' GROUP BY shard_id"
    try:
        a.start(), b.start()
        wait_for(lambda: _states(pg_url) == {10: "verified"}, 60, 0.2, "step 10 verified")
        wait_for(lambda: len(rows := query(pg_url, per_shard)) == 4 and min(n for _, n in rows) >= 3, 60, 0.2,
                 "every shard re-read by scrubs")
        assert query(pg_url, "SELECT count(*) FROM verification_events WHERE outcome = 'deleted'") == [(0,)]
        assert query(pg_url, "SELECT count(*) FROM shards WHERE state <> 'verified'") == [(0,)]
        rotten = disk_b / "run" / "rank_3" / "net-1_10.ckpt"
        st = rotten.stat()
        os.chmod(rotten, 0o600)
        with open(rotten, "r+b") as fh:  # one payload byte flipped in place: size kept
            fh.seek(st.st_size // 2)
            byte = fh.read(1)
            fh.seek(st.st_size // 2)
            fh.write(bytes([byte[0] ^ 0x40]))
        os.chmod(rotten, st.st_mode & 0o777)
        os.utime(rotten, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime kept: a rescan sees nothing
        wait_for(lambda: _states(pg_url) == {10: "corrupt"}, 60, 0.2, "the rotten shard found by B's scrub")
        rows = dict(query(pg_url, "SELECT rank, state FROM shards"))
        assert rows == {0: "verified", 1: "verified", 2: "verified", 3: "corrupt"}
        assert query(pg_url, "SELECT node FROM shards WHERE rank = 3") == [("node-b",)]
        assert query(pg_url, "SELECT count(*) FROM verification_events WHERE outcome = 'deleted'") == [(0,)]
    finally:
        a.stop()
        b.stop()


def test_two_daemons_on_one_shared_directory_split_the_work(ms, tmp_path, pg_url):
    a, b, shared = _shared_nodes(tmp_path, pg_url)
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


def test_an_ask_made_while_a_shard_was_unverified_is_answered_by_another_nodes_later_verdict(ms, tmp_path, pg_url):
    """On a shared root a daemon can read a shard as unverified just before another daemon's
    verdict commits (a rescan's bulk read races the verdict's transaction), so it asks after the
    verdict's timestamp. That ask is answered by the state under the checkpoint's lock, not by
    comparing clocks: the shard is verified once. A scrub's ask (verify again) still verifies."""
    from datetime import datetime, timedelta, timezone

    from sqlalchemy.orm import sessionmaker

    from ckptd import daemon as compose
    from ckptd.catalog.nodes import NodeView
    from tests.daemon_helpers import fast_settings

    shared = tmp_path / "lustre"
    _save(ms, shared, range(TP), 10)
    a = started_daemon(shared, pg_url, node_name="node-a")
    try:
        wait_for(lambda: _states(pg_url) == {10: "verified"}, 60, 0.1, "node-a verified step 10")
    finally:
        a.stop()
    engine = make_engine(pg_url)
    sessions = sessionmaker(engine, expire_on_commit=False)
    b = compose.verifier(fast_settings(shared, pg_url, node_name="node-b"), sessions,
                        NodeView(sessions, "node-b", 120.0, root=str(shared)))
    try:
        ids = [sid for (sid,) in query(pg_url, "SELECT id FROM shards ORDER BY id")]
        events = "SELECT count(*) FROM verification_events WHERE kind = 'shard'"
        # a time asked: verify again unless verified after it (scrub); None: only while unverified (ingest)
        later = datetime.now(timezone.utc) + timedelta(seconds=1)
        b.verify_shards(ids, asks=dict.fromkeys(ids))  # asked while unverified; node-a answered meanwhile
        assert query(pg_url, events) == [(TP,)]
        b.verify_shards(ids, asks=dict.fromkeys(ids, later - timedelta(seconds=3600)))  # node-a verified after that ask
        assert query(pg_url, events) == [(TP,)]
        outcome = b.verify_shards(ids, asks=dict.fromkeys(ids, later))  # a scrub's ask: verify again
        assert set(outcome.values()) == {ShardState.VERIFIED}
        assert query(pg_url, events) == [(2 * TP,)]
        assert query(pg_url, "SELECT DISTINCT node FROM shards") == [("node-a",)]  # verifying is not owning
    finally:
        b.close()
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_catalog_from_before_nodes_upgrades_and_its_rows_are_claimed_by_the_first_rescan(ms, tmp_path, backend):
    """Rows catalogued before migration 0006 have no node: the daemon whose rescan sees the files
    claims them; until then they keep their verdicts (nothing is marked deleted)."""
    from tests.conftest import fresh_pg_database

    url, drop = (f"sqlite:///{tmp_path / 'old.db'}", lambda: None) if backend == "sqlite" else fresh_pg_database()
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
        d = started_daemon(root, url, node_name="node-a")
        try:
            wait_for(lambda: query(url, "SELECT DISTINCT node FROM shards") == [("node-a",)], 30, 0.1, "rows claimed")
            assert query(url, "SELECT DISTINCT state FROM shards") == [("verified",)]
        finally:
            d.stop()
    finally:
        drop()


def _unreachable(node: Node, name: str) -> bool:
    return not {n["name"]: n for n in node.get("/v1/nodes").json()}[name]["reachable"]


def _silent_for(node: Node, name: str) -> float:
    return {n["name"]: n for n in node.get("/v1/nodes").json()}[name]["seconds_since_heartbeat"]


def _shared_nodes(tmp_path: Path, url: str) -> tuple[Node, Node, Path]:
    """Nodes A and B watching one shared directory (Lustre/NFS), not started."""
    shared = tmp_path / "lustre"
    shared.mkdir()
    return (Node("node-a", shared, shared, url, tmp_path / "a.log"), Node("node-b", shared, shared, url, tmp_path / "b.log"),
            shared)


def _split_nodes(ms, tmp_path, url, steps=(10,), timeout: float = 6) -> tuple[Node, Node, Path, Path]:
    """Nodes A (ranks 0-1) and B (ranks 2-3), each with its local disk at the same mount point."""
    mount = tmp_path / "checkpoints"
    mount.mkdir()
    disk_a, disk_b = tmp_path / "disk_a", tmp_path / "disk_b"
    for step in steps:
        _save(ms, disk_a, (0, 1), step)
        _save(ms, disk_b, (2, 3), step)
    return (Node("node-a", disk_a, mount, url, tmp_path / "a.log", timeout),
            Node("node-b", disk_b, mount, url, tmp_path / "b.log", timeout), disk_a, disk_b)


def _launcher_asks_around_the_lost_node(a: Node, tmp_path: Path, monkeypatch) -> None:
    """The launcher's question to a real ckptd: it warns that the answer needs the silent node, and
    ``--exclude-unreachable`` asks for a step without it (none here: every step has B's shards)."""
    from ckptd.launcher.command import LaunchSpec, ask
    from ckptd.launcher.supervise import Log

    monkeypatch.setenv("CKPTD_TOKEN", ADMIN)
    url = f"http://127.0.0.1:{a.port}"
    for exclude in (False, True):
        log_path = tmp_path / f"launcher-{exclude}.log"
        spec = LaunchSpec(["true"], str(tmp_path / "run"), TP, "run", ckptd_url=url, settle_timeout=0,
                          oracle_wait=30, exclude_unreachable=exclude)
        answer = ask(spec, 1, Log(str(log_path)))
        if exclude:
            assert answer.step is None and "node-b" in answer.why
            assert not log_path.exists() or "unreachable_nodes" not in log_path.read_text()
        else:
            assert answer.step == 10 and answer.body["unreachable_nodes"] == ["node-b"]
            assert "event=warning step=10 unreachable_nodes=node-b" in log_path.read_text()


def test_re_verifying_a_run_leaves_an_unreachable_nodes_local_files_alone(ms, tmp_path, pg_url, monkeypatch):
    a, b, _, _ = _split_nodes(ms, tmp_path, pg_url)
    try:
        a.start(), b.start()
        wait_for(lambda: _states(pg_url) == {10: "verified"}, 60, 0.2, "step 10 verified")
        b.kill()
        # past timeout + NodeView.refresh (2 s): node A's own cached view of the nodes has B dead too
        wait_for(lambda: _silent_for(a, "node-b") > b.timeout + 2.5, 30, 0.2, "node-b unreachable in A's view")
        job = a.job("/v1/runs/run/verify", {})
        assert job["state"] == "done", job
        # node A re-verified its own two shards; node B's are B's to judge: not deleted, not counted as done
        assert query(pg_url, "SELECT node, state, count(*) FROM shards GROUP BY node, state ORDER BY node") == [
            ("node-a", "verified", 2), ("node-b", "verified", 2)]
        assert _states(pg_url) == {10: "verified"}
        assert job["result"]["shards"] == {"verified": 2}
        assert job["result"]["other_nodes"] == {"node-b": 2}
        assert a.get("/v1/runs/run/resume", lease="false").json()["step"] == 10
        # the step's shards say whose they are and whether that node is alive
        shards = a.get("/v1/runs/run/steps/10").json()["shards"]
        assert {(x["rank"], x["node"], x["reachable"]) for x in shards} == {
            (0, "node-a", True), (1, "node-a", True), (2, "node-b", False), (3, "node-b", False)}
        _launcher_asks_around_the_lost_node(a, tmp_path, monkeypatch)
        # with node B alive, its shards are reported as held by it, not as verified here
        b.start()
        job = a.job("/v1/runs/run/verify", {"step": 10})
        assert job["result"]["other_nodes"] == {"node-b": 2} and job["result"]["shards"] == {"verified": 2}
        assert _states(pg_url) == {10: "verified"}
    finally:
        a.stop()
        b.stop()


def test_on_a_shared_directory_a_dead_nodes_really_deleted_file_is_marked_deleted(ms, tmp_path, pg_url):
    a, b, shared = _shared_nodes(tmp_path, pg_url)
    try:
        a.start()
        _save(ms, shared, range(TP), 10)
        wait_for(lambda: _states(pg_url) == {10: "verified"}, 60, 0.2, "step 10 verified by node-a")
        assert query(pg_url, "SELECT DISTINCT node FROM shards") == [("node-a",)]
        assert (shared / ".ckptd-node-node-a").is_file()  # node A's sharing marker
        b.start()
        a.kill()
        wait_for(lambda: _unreachable(b, "node-a"), 30, 0.2, "node-a unreachable")
        lost = shared / "run" / "rank_1" / "net-1_10.ckpt"
        os.chmod(lost, 0o600)
        os.remove(lost)
        # node B sees node A's marker: A watched this very directory, so a file B cannot see is gone
        wait_for(lambda: query(pg_url, "SELECT state FROM shards WHERE path = :p", p=str(lost)) == [("deleted",)],
                 30, 0.2, "the lost file of dead node-a marked deleted by node-b")
        assert _states(pg_url) == {10: "deleted"}
        # the files B sees are B's from its next rescan on (the deletion may have come from B's file
        # event, before that rescan), and keep their verdict
        wait_for(lambda: query(pg_url, "SELECT node, state FROM shards WHERE path <> :p", p=str(lost))
                 == [("node-b", "verified")] * 3, 30, 0.2, "node-b owns the files it sees")
    finally:
        a.stop()
        b.stop()


def test_an_upgraded_multi_node_catalog_keeps_the_other_nodes_unowned_rows(ms, tmp_path):
    """Rows from before migration 0006 have no node. The first daemon up must not mark the ones it
    cannot see (node B's, on B's local disk) deleted before B had a node timeout to register."""
    from tests.conftest import fresh_pg_database

    url, drop = fresh_pg_database()
    try:
        a, b, _, _ = _split_nodes(ms, tmp_path, url, timeout=60)
        engine = make_engine(url)
        upgrade(engine, "0005")  # a catalog as the previous release left it, both nodes' rows in it
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO runs (id, name, path, created_at) VALUES (1, 'run', '%s', CURRENT_TIMESTAMP)"
                                 % (a.mount / "run"))
            conn.exec_driver_sql(
                "INSERT INTO checkpoints (id, run_id, prefix, epoch, step, kind, layout, state, expected_ranks, pinned, "
                "marked_bad, created_at, updated_at) VALUES (1, 1, 'net', 1, 10, 'trained', '', 'verified', 4, false, "
                "false, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)")
            for r, disk in ((0, a.disk), (1, a.disk), (2, b.disk), (3, b.disk)):
                st = (disk / "run" / f"rank_{r}" / "net-1_10.ckpt").stat()
                conn.exec_driver_sql(
                    "INSERT INTO shards (checkpoint_id, rank, path, size, mtime_ns, inode, state, quarantined, verify_seq, "
                    f"seen_at) VALUES (1, {r}, '{a.mount / 'run' / f'rank_{r}' / 'net-1_10.ckpt'}', {st.st_size}, "
                    f"{st.st_mtime_ns}, {st.st_ino}, 'verified', false, 0, CURRENT_TIMESTAMP)")
        upgrade(engine)
        engine.dispose()
        try:
            a.start()  # its first rescan is done: it claimed what it sees, and judged nothing else
            assert query(url, "SELECT rank, node, state FROM shards ORDER BY rank") == [
                (0, "node-a", "verified"), (1, "node-a", "verified"), (2, None, "verified"), (3, None, "verified")]
            b.start()
            assert query(url, "SELECT rank, node, state FROM shards ORDER BY rank") == [
                (0, "node-a", "verified"), (1, "node-a", "verified"), (2, "node-b", "verified"), (3, "node-b", "verified")]
            assert query(url, "SELECT count(*) FROM verification_events WHERE outcome = 'deleted'") == [(0,)]
            assert _states(url) == {10: "verified"}
        finally:
            a.stop()
            b.stop()
    finally:
        drop()


def test_a_converted_copy_belongs_to_the_node_that_wrote_it(ms, tmp_path, pg_url):
    root = tmp_path / "root"
    root.mkdir()
    a = Node("node-a", root, root, pg_url, tmp_path / "a.log")
    try:
        a.start()
        _save(ms, root, range(TP), 10)
        wait_for(lambda: _states(pg_url) == {10: "verified"}, 60, 0.2, "step 10 verified")
        job = a.job("/v1/runs/run/conversions", {"step": 10, "to_layout": "tp=2,dp=1"})
        assert job["state"] == "done", job
        assert query(pg_url, "SELECT DISTINCT s.node FROM shards s JOIN checkpoints c ON c.id = s.checkpoint_id "
                             "WHERE c.kind = 'converted'") == [("node-a",)]
    finally:
        a.stop()
