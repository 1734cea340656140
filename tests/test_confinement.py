"""Hostile trees: ckptd never reads or writes outside its root, never follows a symlink, never
blocks on a FIFO, never opens a device (issue 15, findings 1-3). Real daemon, real files."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from ckptd import confine
from ckptd.daemon import Daemon
from ckptd.settings import Settings
from tests.daemon_helpers import query, save_shard, step_states, wait_for, write_tp_strategy


@pytest.fixture
def root(tmp_path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


@pytest.fixture
def outside(tmp_path) -> Path:
    o = tmp_path / "outside"
    o.mkdir()
    return o


def _daemon(root: Path, url: str) -> Daemon:
    d = Daemon(Settings(root=root, db=url, settle_seconds=0.2, rescan_interval=0.5, debounce=0.02))
    d.start()
    return d


# --- the one function ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_open_beneath_refuses_every_escape(root, outside):
    (root / "run" / "rank_0").mkdir(parents=True)
    (root / "run" / "rank_0" / "ok.ckpt").write_bytes(b"x")
    (outside / "secret").write_bytes(b"s3cret")
    os.symlink(outside, root / "run" / "strategy")  # a symlinked directory component
    os.symlink(outside / "secret", root / "run" / "link.ckpt")  # a symlinked file
    os.mkfifo(root / "run" / "fifo.ckpt")
    os.mknod(root / "run" / "null.ckpt", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    (root / "run" / "dir.ckpt").mkdir()
    assert confine.read_beneath(str(root), str(root / "run" / "rank_0" / "ok.ckpt"), 10) == b"x"
    cases = {
        root / "run" / "strategy" / "secret": "symlink or not a directory",
        root / "run" / "link.ckpt": "symlink",
        root / "run" / "fifo.ckpt": "FIFO",
        root / "run" / "null.ckpt": "character device",
        root / "run" / "dir.ckpt": "directory",
        root / ".." / "outside" / "secret": "outside the checkpoint root",
    }
    for path, why in cases.items():  # a FIFO that blocked would hang here: the test's timeout fails it
        with pytest.raises(confine.ConfinementError, match=why):
            confine.read_beneath(str(root), str(path), 100)
    with pytest.raises(confine.ConfinementError):
        confine.make_dirs_beneath(str(root), str(root / "run" / "strategy" / "new"))
    assert not (outside / "new").exists()
    with pytest.raises(confine.ConfinementError, match="more than"):
        confine.read_beneath(str(root), str(root / "run" / "rank_0" / "ok.ckpt"), 0)


# --- the daemon ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_fifos_never_freeze_the_daemon(ms, root, catalog_url):
    write_tp_strategy(root / "r")
    for rank in range(2):
        save_shard(ms, root, "r", rank, 2)
        os.mkfifo(root / "r" / f"rank_{rank}" / "net-1_2.ckpt.done")  # the verifier reads sidecars
    (root / "f").mkdir()
    os.mkfifo(root / "f" / "strategy.ckpt")  # the ingest thread reads strategy files
    (root / "f" / "rank_0").mkdir()
    os.mkfifo(root / "f" / "rank_0" / "net-1_2.ckpt")  # named like a shard
    d = _daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step verified despite the FIFOs")
        assert query(catalog_url, "SELECT count(*) FROM shards WHERE path LIKE :p", p=f"{root / 'f'}%") == [(0,)]
        assert query(catalog_url, "SELECT count(*) FROM strategy_files WHERE path LIKE :p", p=f"{root / 'f'}%") == [(0,)]
    finally:
        d.stop()  # a worker blocked in open() would hold this: the test's timeout fails it
        assert all(not t.is_alive() for t in threading.enumerate() if t.name.startswith("ckptd-verify"))


def test_symlinks_are_never_followed_at_start_or_while_running(ms, root, outside, catalog_url, caplog):
    # a run whose strategy/ directory points outside the root
    (outside / "strategy").mkdir()
    write_tp_strategy(outside / "strategy_src")
    os.replace(outside / "strategy_src" / "strategy.ckpt", outside / "strategy" / "stage0.ckpt")
    (root / "run1").mkdir()
    os.symlink(outside / "strategy", root / "run1" / "strategy")
    for rank in range(2):
        save_shard(ms, root, "run1", rank, 2)
    # a sidecar pointing outside
    (outside / "hint.json").write_text('{"size": 1, "xxh3_128": "0"}')
    os.symlink(outside / "hint.json", root / "run1" / "rank_0" / "net-1_2.ckpt.done")
    caplog.set_level(logging.INFO)
    d = _daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step 2 verified")
        # the outside strategy was not read, bound or served; the outside sidecar was not believed
        assert query(catalog_url, "SELECT count(*) FROM strategy_files") == [(0,)]
        assert query(catalog_url, "SELECT strategy_id FROM checkpoints") == [(None,)]
        # created while the daemon runs (the event path): strategy.ckpt -> a file outside
        (outside / "passwd").write_text("root:x:0:0:SECRET-CONTENT:/root:/bin/sh\n")
        os.symlink(outside / "passwd", root / "run1" / "strategy.ckpt")
        d.watcher.poke(str(root / "run1" / "strategy.ckpt"))
        time.sleep(1.5)
        assert query(catalog_url, "SELECT count(*) FROM strategy_files") == [(0,)]
    finally:
        d.stop()
    assert "SECRET-CONTENT" not in caplog.text
    assert "ignoring" in caplog.text and "symlink" in caplog.text


def test_a_symlinked_converted_directory_cannot_redirect_a_conversion(ms, root, outside, catalog_url):
    from ckptd.service.conversions import convert_step

    write_tp_strategy(root / "run6")
    for rank in range(2):
        save_shard(ms, root, "run6", rank, 2)
    d = _daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step 2 verified")
        os.symlink(outside, root / "run6" / "converted")
        with pytest.raises(confine.ConfinementError, match="symlink"):
            convert_step(d.sessions, str(root), "run6", 2, to_layout="tp=1,dp=1")
        assert list(outside.iterdir()) == []  # nothing written outside: no copy, no strategy, no temp dir
        assert query(catalog_url, "SELECT count(*) FROM checkpoints WHERE kind = 'converted'") == [(0,)]
    finally:
        d.stop()


def test_hostile_names_get_one_reason_and_no_traceback(ms, root, catalog_url, caplog):
    write_tp_strategy(root / "run")
    for rank in range(2):
        save_shard(ms, root, "run", rank, 2)
    os.mkdir(os.path.join(os.fsencode(root), b"bad-\xff-run"))  # not UTF-8
    (root / "run" / "rank_0" / "net-1_99999999999999999999.ckpt").write_bytes(b"x")  # beyond BIGINT
    (root / "run" / "rank_99999999999999999999").mkdir()  # an empty, planted rank directory
    (root / "run2" / "rank_0").mkdir(parents=True)
    (root / "run2" / "rank_1").mkdir()  # empty: not a rank of this job
    save_shard(ms, root, "run2", 0, 2)
    caplog.set_level(logging.WARNING)
    d = _daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"} and
                 len(query(catalog_url, "SELECT id FROM checkpoints")) == 2, 60, what="both runs' steps")
        time.sleep(1.5)  # several rescans
    finally:
        d.stop()
    assert query(catalog_url, "SELECT r.name, c.expected_ranks, c.state FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                              "ORDER BY r.name") == [("run", 2, "verified"), ("run2", 1, "verified")]
    assert "Traceback" not in caplog.text
    assert caplog.text.count("not valid UTF-8") == 1 and caplog.text.count("beyond") == 1


def test_healthz_reports_a_worker_without_progress(ms, root, catalog_url):
    """A worker busy with one unit of work past worker_stall_seconds makes /healthz answer 503
    'stalled' (here: a large shard and a tiny threshold, so the real verification counts as stuck)."""
    import numpy as np

    from tests.api_helpers import Server

    write_tp_strategy(root / "big", tp=1)
    big = {"w": np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32),
           "b": np.zeros(3, np.float32), "pad": np.ones((4096, 16384), np.float32)}  # 256 MiB to verify
    save_shard(ms, root, "big", 0, 2, tensors=big)
    settings = Settings(root=root, db=catalog_url, settle_seconds=0.2, rescan_interval=0.5, debounce=0.02,
                        worker_stall_seconds=0.01)
    seen: set[tuple[int, str]] = set()
    with Server(settings) as srv, srv.client() as c:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (503, "stalled") not in seen:
            r = c.get("/healthz")
            seen.add((r.status_code, r.json()["status"]))
            if r.status_code == 503:
                assert r.json()["stalled"] and all(v > 0.01 for v in r.json()["stalled"].values())
        wait_for(lambda: query(catalog_url, "SELECT count(*) FROM shards WHERE state = 'verified'") == [(1,)], 60,
                 what="the big shard verified")
        wait_for(lambda: c.get("/healthz").json()["status"] == "ok", 30, what="healthy again")  # progress again
    assert (503, "stalled") in seen
