"""The settled barrier (issue 21, item 4): before the launcher asks where to resume, ckptd must have
judged every save committed under the run -- whatever its layout and format. Real files
(``mindspore.save_checkpoint(format="safetensors")``, a Checkpoint 2.0 iteration whose records
MindFormers' own code wrote), a real daemon behind real HTTP.

The daemon examines file events only after ``debounce`` = 0.5 s here, so a barrier that did not ask
ckptd's own machinery (and returned before the files were even catalogued) is caught every time.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptd.launcher.freshstart import FreshStart
from ckptd.launcher.oracle import ResumeAnswer, committed_save_files
from ckptd.launcher.supervise import Log, settle
from ckptd.settings import Settings
from tests.api_helpers import Server
from tests.mf2_fixtures import make_records, write_files

WORLD = 2


@pytest.fixture(scope="module")
def saves(ms, tmp_path_factory) -> Path:
    """Staged runs, copied into each test's root: ``st`` (native rank directories, safetensors, steps
    2 and 4 by both ranks) and ``it`` (Checkpoint 2.0: iteration 10 of a dp=2 x tp=2 job)."""
    staged = tmp_path_factory.mktemp("staged")
    for rank in range(WORLD):
        rank_dir = staged / "st" / f"rank_{rank}"
        rank_dir.mkdir(parents=True)
        for step in (2, 4):
            data = [{"name": "w", "data": ms.Tensor([[float(step + rank)] * 4] * 2)}]
            ms.save_checkpoint(data, str(rank_dir / f"net-1_{step}.safetensors"),
                               append_dict={"step_num": step, "rank_id": rank}, format="safetensors")
    ckpt = staged / "it" / "checkpoint"
    make_records(ckpt, plain=[10])
    write_files(ms, ckpt / "iteration_00000010", 10)
    return staged


def _server(root: Path, url: str) -> Server:
    # events are examined 0.5 s late; no periodic rescan: only the barrier's own question finds the files in time
    return Server(Settings(root=root, db=url, debounce=0.5, rescan_interval=3600, settle_seconds=0.2))


def _steps(srv: Server, run: str) -> dict[int, str]:
    with srv.client() as c:
        r = c.get(f"/v1/runs/{run}/steps")
    return {s["training_step"]: s["state"] for s in r.json()} if r.status_code == 200 else {}


@pytest.mark.parametrize("run, newest", [("st", 4), ("it", 10)])
def test_the_barrier_waits_until_ckptd_judged_the_newest_save(saves, root, catalog_url, tmp_path, run, newest):
    """safetensors in rank directories and a Checkpoint 2.0 iteration: when the barrier returns,
    ckptd has judged the newest save, and the launcher's log line says so."""
    with _server(root, catalog_url) as srv:
        shutil.copytree(saves / run, root / run)
        log_path = tmp_path / "launcher.log"
        settle(srv.url, run, 30, Log(str(log_path)), 1)
        states = _steps(srv, run)
    assert states.get(newest) == "verified", states
    line = next((l for l in log_path.read_text().splitlines() if "event=catalog_" in l), "")
    assert "attempt=1 event=catalog_settled" in line and f"{newest}=verified" in line, line


@pytest.mark.parametrize("run, shown", [("st", "rank_0/net-1_4.safetensors"),
                                        ("it", "checkpoint/iteration_00000010")])
def test_never_a_silent_fresh_start_sees_safetensors_and_checkpoint_2_0_saves(saves, run, shown):
    """The fresh-start guard lists the saves on disk when the oracle does not know the run."""
    run_dir = str(saves / run)
    assert committed_save_files(run_dir, WORLD)[0] == shown
    unknown = ResumeAnswer(None, None, "ckptd: run not in the catalog yet", catalogued=False)
    refused = FreshStart().refusal(run_dir, WORLD, unknown)
    assert refused is not None and shown in refused, refused


def test_the_answer_names_each_nodes_unjudged_work(saves, root, catalog_url, tmp_path):
    """Another node's catalogued shards without a verdict hold the barrier while that node is
    reachable, and are named; once it is silent past node_timeout they are listed, not waited for.
    Node ``far`` is real ingest (its files, its catalog rows) whose verifier never ran: a node that
    died right after cataloguing its save."""
    from ckptd.catalog import nodes as node_registry
    from ckptd.catalog.db import make_engine
    from ckptd.catalog.nodes import NodeView
    from ckptd import daemon as compose
    from sqlalchemy.orm import sessionmaker

    far_root = tmp_path / "far"
    shutil.copytree(saves / "st", far_root / "st")
    far = Settings(root=far_root, db=catalog_url, node_name="far", node_timeout=1.0, settle_seconds=0.2)
    engine = make_engine(catalog_url)
    sessions = sessionmaker(engine, expire_on_commit=False)
    # node_timeout 3 s, with far's heartbeat renewed just before the first question: on a loaded
    # CI machine the rescan alone has taken longer than a 1 s timeout, and far was then judged silent
    with Server(Settings(root=root, db=catalog_url, node_timeout=3.0, heartbeat_interval=0.2)) as srv:
        with sessions.begin() as s:
            node_registry.register(s, "far", str(far_root))
        compose.ingestor(far, sessions, NodeView(sessions, "far", 3.0, root=str(far_root)), lambda *a, **k: None,
                        lambda _id: None).rescan()
        with sessions.begin() as s:
            node_registry.heartbeat(s, "far")
        with srv.client() as c:
            held = c.get("/v1/runs/st/settled", params={"wait": 0.3}).json()
            assert not held["settled"] and held["rescanned"] and held["node"] == srv.daemon.settings.node_name
            assert [(u["node"], u["reachable"], u["shards"], u["blocking"]) for u in held["unjudged"]] == \
                [("far", True, 4, True)], held
            assert sorted(held["unjudged"][0]["steps"]) == ["2", "4"]
            # the launcher asks anyway (its settle wait ran out): "nothing restorable" from a ckptd that
            # has not judged the saves is no verdict on them, and never a start from step 0 (issue 25.1)
            from ckptd.launcher.oracle import ask_http

            answer = ask_http(srv.url, "st", WORLD)
            assert answer.step is None and answer.catalogued and answer.unjudged == (4, 2), answer
            refused = FreshStart().refusal(str(far_root / "st"), WORLD, answer)
            assert refused is not None and "not finished verifying step(s) 4, 2" in refused, refused
            assert "--settle-timeout" in refused and "--allow-fresh-start" in refused
            assert FreshStart(allowed=True).refusal(str(far_root / "st"), WORLD, answer) is None
            # silent past node_timeout: nobody will judge those files soon, so they no longer hold the barrier
            gone = c.get("/v1/runs/st/settled", params={"wait": 30}).json()
            assert gone["settled"] and [(u["node"], u["reachable"], u["blocking"]) for u in gone["unjudged"]] == \
                [("far", False, False)], gone
            # nobody judges those saves until node far comes back: not a wait for --settle-timeout, and
            # still never a silent start from step 0 -- the refusal names the node
            answer = ask_http(srv.url, "st", WORLD)
            assert answer.step is None and answer.unjudged == () and answer.unjudged_unreachable == \
                {"2": ["far"], "4": ["far"]}, answer
            refused = FreshStart().refusal(str(far_root / "st"), WORLD, answer)
            assert refused is not None and "step(s) 2 (node far), 4 (node far) await a verdict only a silent node" \
                in refused and "--allow-fresh-start" in refused, refused
            unknown = c.get("/v1/runs/nothing-here/settled")  # default wait: 10 s; after the rescan, a definite "no such run"
            assert unknown.status_code == 404 and unknown.json()["detail"]["code"] == "not_found", unknown.text
            not_yet = c.get("/v1/runs/nothing-here/settled", params={"wait": 0}).json()  # before the rescan: not known
            assert not not_yet["settled"] and not not_yet["catalogued"]
            assert c.get("/v1/runs/st/settled", params={"wait": 601}).status_code == 422
    engine.dispose()


def test_one_liveness_answer_for_a_running_an_exited_and_a_reused_pid():
    import subprocess
    import sys

    from ckptd import procs

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        st = procs.stat(child.pid)
        assert st is not None and procs.alive(child.pid) and procs.alive(child.pid, st.start)
        assert procs.why_gone(child.pid, st.start + 1) == "is not running (the pid belongs to a newer process)"
        assert child.pid in procs.children().get(procs.stat(child.pid).ppid, [])
    finally:
        child.stdin.close()
    import time as _time

    while procs.stat(child.pid) is not None and procs.stat(child.pid).state not in ("Z", "X"):
        _time.sleep(0.01)  # exited, not reaped yet: a zombie, which kill(pid, 0) would call alive
    assert procs.why_gone(child.pid) == "has exited"
    child.wait()
    assert procs.why_gone(child.pid) == "is not running" and not procs.alive(0)
