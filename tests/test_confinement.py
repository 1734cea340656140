"""Hostile trees: ckptd never reads or writes outside its root, never follows a symlink, never
blocks on a FIFO, never opens a device (issue 15, findings 1-3). Real daemon, real files."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

import pytest

from ckptd.split import parse_split
from ckptd.storage import ConfinementError, PosixStorage
from tests.daemon_helpers import (fast_settings, query, save_shard, save_tp_step, started_daemon, step_states, wait_for,
                                  wait_for_rescans, write_tp_strategy)


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
    assert PosixStorage(str(root)).read(str(root / "run" / "rank_0" / "ok.ckpt"), 10) == b"x"
    cases = {
        root / "run" / "strategy" / "secret": "symlink or not a directory",
        root / "run" / "link.ckpt": "symlink",
        root / "run" / "fifo.ckpt": "FIFO",
        root / "run" / "null.ckpt": "character device",
        root / "run" / "dir.ckpt": "directory",
        root / ".." / "outside" / "secret": "outside the checkpoint root",
    }
    for path, why in cases.items():  # a FIFO that blocked would hang here: the test's timeout fails it
        with pytest.raises(ConfinementError, match=why):
            PosixStorage(str(root)).read(str(path), 100)
    with pytest.raises(ConfinementError):
        PosixStorage(str(root)).open_dir(str(root / "run" / "strategy" / "new"), create=True)
    assert not (outside / "new").exists()
    with pytest.raises(ConfinementError, match="more than"):
        PosixStorage(str(root)).read(str(root / "run" / "rank_0" / "ok.ckpt"), 0)


# --- the daemon ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_fifos_never_freeze_the_daemon(ms, root, catalog_url):
    save_tp_step(ms, root, "r", 2)
    for rank in range(2):
        os.mkfifo(root / "r" / f"rank_{rank}" / "net-1_2.ckpt.done")  # the verifier reads sidecars
    (root / "f").mkdir()
    os.mkfifo(root / "f" / "strategy.ckpt")  # the ingest thread reads strategy files
    (root / "f" / "rank_0").mkdir()
    os.mkfifo(root / "f" / "rank_0" / "net-1_2.ckpt")  # named like a shard
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step verified despite the FIFOs")
        assert query(catalog_url, "SELECT count(*) FROM shards WHERE path LIKE :p", p=f"{root / 'f'}%") == [(0,)]
        assert query(catalog_url, "SELECT count(*) FROM strategy_files WHERE path LIKE :p", p=f"{root / 'f'}%") == [(0,)]
    finally:
        d.stop()  # a worker blocked in open() would hold this: the test's timeout fails it
        alive = [t.name for t in threading.enumerate() if t.name.startswith("ckptd-verify") and t.is_alive()]
        assert not alive, alive


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
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step 2 verified")
        # the outside strategy was not read, bound or served; the outside sidecar was not believed
        assert query(catalog_url, "SELECT count(*) FROM strategy_files") == [(0,)]
        assert query(catalog_url, "SELECT strategy_id FROM checkpoints") == [(None,)]
        # created while the daemon runs (the event path): strategy.ckpt -> a file outside
        (outside / "passwd").write_text("root:x:0:0:SECRET-CONTENT:/root:/bin/sh\n")
        os.symlink(outside / "passwd", root / "run1" / "strategy.ckpt")
        d.watcher.poke(str(root / "run1" / "strategy.ckpt"))
        wait_for_rescans(d)  # the event examined and a whole rescan since: neither read it
        assert query(catalog_url, "SELECT count(*) FROM strategy_files") == [(0,)]
    finally:
        d.stop()
    assert "SECRET-CONTENT" not in caplog.text
    assert "ignoring" in caplog.text and "symlink" in caplog.text


def test_a_symlinked_converted_directory_cannot_redirect_a_conversion(ms, root, outside, catalog_url):
    from ckptd.service.conversions import convert_step

    save_tp_step(ms, root, "run6", 2)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step 2 verified")
        os.symlink(outside, root / "run6" / "converted")
        with pytest.raises(ConfinementError, match="symlink"):
            convert_step(d.sessions, PosixStorage(str(root)), "run6", 2, split=parse_split("tp=1,dp=1"))
        assert list(outside.iterdir()) == []  # nothing written outside: no copy, no strategy, no temp dir
        assert query(catalog_url, "SELECT count(*) FROM checkpoints WHERE kind = 'converted'") == [(0,)]
    finally:
        d.stop()


def test_hostile_names_get_one_reason_and_no_traceback(ms, root, catalog_url, caplog):
    save_tp_step(ms, root, "run", 2)
    os.mkdir(os.path.join(os.fsencode(root), b"bad-\xff-run"))  # not UTF-8
    (root / "run" / "rank_0" / "net-1_99999999999999999999.ckpt").write_bytes(b"x")  # beyond BIGINT
    (root / "run" / "rank_99999999999999999999").mkdir()  # an empty, planted rank directory
    (root / "run2" / "rank_0").mkdir(parents=True)
    (root / "run2" / "rank_1").mkdir()  # empty: not a rank of this job
    save_shard(ms, root, "run2", 0, 2)
    caplog.set_level(logging.WARNING)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"} and
                 len(query(catalog_url, "SELECT id FROM checkpoints")) == 2, 60, what="both runs' steps")
        wait_for_rescans(d, 3)  # two whole rescans at least, after both steps were in: nothing more is said
    finally:
        d.stop()
    assert query(catalog_url, "SELECT r.name, c.expected_ranks, c.state FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                              "ORDER BY r.name") == [("run", 2, "verified"), ("run2", 1, "verified")]
    assert "Traceback" not in caplog.text
    assert caplog.text.count("not valid UTF-8") == 1 and caplog.text.count("beyond") == 2  # the file, the rank dir
    assert caplog.text.count("rank 99999999999999999999 is beyond") == 1


def test_a_step_waiting_for_a_file_ckptd_never_reads_says_why(ms, root, outside, catalog_url, caplog):
    """Finding 9: a rank's file that is a FIFO, a directory or a symlink named like a shard, or a
    rank directory that is a symlink, left the step incomplete with no reason at all."""
    kinds = {"fifo": lambda p: os.mkfifo(p), "dir": lambda p: os.mkdir(p),
             "link": lambda p: os.symlink(outside / "elsewhere.ckpt", p)}
    (outside / "elsewhere.ckpt").write_bytes(b"x")
    for run, make in kinds.items():
        write_tp_strategy(root / run)
        save_shard(ms, root, run, 1, 2)
        (root / run / "rank_0").mkdir()
        make(root / run / "rank_0" / "net-1_2.ckpt")
    write_tp_strategy(root / "linked")
    save_shard(ms, root, "linked", 1, 2)
    save_shard(ms, outside, "elsewhere", 0, 2)
    os.symlink(outside / "elsewhere" / "rank_0", root / "linked" / "rank_0")
    caplog.set_level(logging.WARNING)
    d = started_daemon(root, catalog_url)
    try:
        def reasons():
            rows = query(catalog_url, "SELECT r.name, c.state, c.reason FROM checkpoints c JOIN runs r ON r.id = c.run_id")
            return {run: (state, reason) for run, state, reason in rows} if len(rows) == 4 and all(
                reason for _, _, reason in rows) else None
        got = wait_for(reasons, 60, what="every waiting step to say why")
        wait_for_rescans(d, 3)  # two whole rescans more at least: reasons and log lines once
        assert reasons() == got
    finally:
        d.stop()
    assert got["fifo"] == ("incomplete", "rank 0: net-1_2.ckpt is a FIFO, not a regular file: never read")
    assert got["dir"] == ("incomplete", "rank 0: net-1_2.ckpt is a directory, not a regular file: never read")
    assert got["link"] == ("incomplete", "rank 0: net-1_2.ckpt is a symlink, not a regular file: never read")
    assert got["linked"] == ("incomplete", "rank 0: its directory rank_0 is a symlink: never followed")
    assert caplog.text.count("a rank directory that is a symlink") == 1
    assert query(catalog_url, "SELECT count(*) FROM shards WHERE rank = 0") == [(0,)]


def test_special_files_created_while_running_never_freeze_or_fool_the_daemon(ms, root, catalog_url):
    """The event path (files appearing while the daemon runs), with a FIFO and a character device
    (``mknod c 1 3``, what /dev/null is) as sidecars of verified shards and as a shard of a new step."""
    save_tp_step(ms, root, "r", 2)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step 2 verified")
        os.mkfifo(root / "r" / "rank_0" / "net-1_2.ckpt.done")
        os.mknod(root / "r" / "rank_1" / "net-1_2.ckpt.done", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        save_shard(ms, root, "r", 1, 4)
        os.mknod(root / "r" / "rank_0" / "net-1_4.ckpt", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        for p in ("rank_0/net-1_2.ckpt.done", "rank_1/net-1_2.ckpt.done", "rank_0/net-1_4.ckpt"):
            d.watcher.poke(str(root / "r" / p))
        wait_for(lambda: query(catalog_url, "SELECT reason FROM checkpoints WHERE step = 4") ==
                 [("rank 0: net-1_4.ckpt is a character device, not a regular file: never read",)], 60,
                 what="step 4 saying why it waits")
        assert step_states(catalog_url) == {2: "verified", 4: "incomplete"}  # the special sidecars were not believed
        assert query(catalog_url, "SELECT count(*) FROM shards WHERE path LIKE '%net-1_4.ckpt' AND rank = 0") == [(0,)]
    finally:
        d.stop()
        alive = [t.name for t in threading.enumerate() if t.name.startswith("ckptd-verify") and t.is_alive()]
        assert not alive, alive


def test_healthz_reports_a_worker_without_progress(ms, root, catalog_url):
    """A worker busy with one unit of work past worker_stall_seconds makes /healthz answer 503
    'stalled' (here: a large shard and a tiny threshold, so the real verification counts as stuck)."""
    import numpy as np

    from tests.api_helpers import Server

    write_tp_strategy(root / "big", tp=1)
    big = {"w": np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32),
           "b": np.zeros(3, np.float32), "pad": np.ones((4096, 16384), np.float32)}  # 256 MiB to verify
    save_shard(ms, root, "big", 0, 2, tensors=big)
    settings = fast_settings(root, catalog_url, worker_stall_seconds=0.01)
    seen: set[tuple[int, str]] = set()
    with Server(settings) as srv, srv.client() as c:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (503, "stalled") not in seen:
            r = c.get("/healthz")
            seen.add((r.status_code, r.json()["status"]))
            if r.status_code == 503:
                # seconds are reported rounded to 0.01: a worker just past the threshold reads 0.01
                assert r.json()["stalled"] and all(v >= 0.01 for v in r.json()["stalled"].values())
        wait_for(lambda: query(catalog_url, "SELECT count(*) FROM shards WHERE state = 'verified'") == [(1,)], 60,
                 what="the big shard verified")
        wait_for(lambda: c.get("/healthz").json()["status"] == "ok", 30, what="healthy again")  # progress again
    assert (503, "stalled") in seen
