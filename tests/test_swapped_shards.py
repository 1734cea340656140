"""A catalogued, verified shard swapped afterwards — for a symlink to a file outside the root, a
FIFO, or its rank directory for a symlinked directory — must not stay ``verified`` nor be served
by the resume oracle: while the daemon runs (file events, rescans) and across a restart (issue 15).
Real daemon, real files; a FIFO opened by mistake would hang the test until its own timeout."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import pytest

from ckptd.daemon import Daemon
from ckptd.service.resume import resume
from tests.daemon_helpers import query, save_shard, save_tp_step, started_daemon, step_states, wait_for, write_tp_strategy


def _swap(kind: str, root: Path, outside: Path) -> None:
    shard = root / "r" / "rank_0" / "net-1_2.ckpt"
    tmp = root / "r" / "rank_0" / "tmp"
    if kind == "symlink":
        shutil.copy(shard, outside / "elsewhere.ckpt")
        os.symlink(outside / "elsewhere.ckpt", tmp)
        os.replace(tmp, shard)  # atomic, as a hostile writer would
    elif kind == "fifo":
        os.mkfifo(tmp)
        os.replace(tmp, shard)
    else:  # the rank directory for a symlinked copy outside the root (step 1's shard stays a real file there too)
        shutil.copytree(root / "r" / "rank_0", outside / "rank_0")
        os.symlink(outside / "rank_0", root / "r" / "link")
        _exchange(root / "r" / "link", root / "r" / "rank_0")  # atomic: no moment without a rank_0
        os.rename(root / "r" / "link", outside / "rank_0_moved")


def _exchange(a: Path, b: Path) -> None:
    """Swap two names atomically (renameat2 RENAME_EXCHANGE), as a hostile writer can: a rescan
    never sees the rank directory missing (its shards would then be, truthfully, deleted)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def _answer(d: Daemon):
    with d.sessions() as s:
        try:
            return resume(s, "r")
        except Exception as err:  # noqa: BLE001 - NoRestorableStepError carries the skipped steps
            return {"step": None, "skipped": getattr(err, "skipped", [])}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("restart", [False, True], ids=["running", "restart"])
@pytest.mark.parametrize("kind", ["symlink", "fifo", "symlinked_rank_dir"])
def test_a_swapped_shard_is_no_longer_verified_nor_served(ms, tmp_path, catalog_url, kind, restart):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    write_tp_strategy(root / "r")
    for rank in range(2):
        for step in (1, 2):
            save_shard(ms, root, "r", rank, step)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {1: "verified", 2: "verified"}, 60, what="both steps verified")
        assert _answer(d)["step"] == 2
        if restart:
            d.stop()
            d = None
        _swap(kind, root, outside)
        if restart:
            d = started_daemon(root, catalog_url)
        wait_for(lambda: step_states(catalog_url)[2] == "corrupt", 60, what="step 2 no longer verified")
        answer = _answer(d)
        reasons = {sk["step"]: sk["reason"] for sk in answer["skipped"]}
        assert answer["step"] != 2 and "replaced" in reasons[2], answer
        if kind == "symlinked_rank_dir":  # both steps' rank-0 shards are behind the symlink now
            wait_for(lambda: step_states(catalog_url)[1] == "corrupt", 60, what="step 1 no longer verified")
        else:
            assert answer["step"] == 1 and str(root / "r" / "rank_0" / "net-1_1.ckpt") in str(answer["shards"])
        assert query(catalog_url, "SELECT count(*) FROM shards WHERE path = :p AND state = 'verified'",
                     p=str(root / "r" / "rank_0" / "net-1_2.ckpt")) == [(0,)]
    finally:
        if d is not None:
            d.stop()


@pytest.mark.timeout(120)
def test_a_swapped_strategy_file_is_not_served(ms, tmp_path, catalog_url):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    save_tp_step(ms, root, "r", 2)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step verified")
        strategy = root / "r" / "strategy.ckpt"
        assert _answer(d)["strategy_file"] == str(strategy)
        shutil.copy(strategy, outside / "strategy.ckpt")
        os.symlink(outside / "strategy.ckpt", root / "r" / "tmp")
        os.replace(root / "r" / "tmp", strategy)
        answer = _answer(d)
        assert answer["step"] == 2 and answer["strategy_file"] is None and answer["strategy_hash"]
    finally:
        d.stop()
