"""gc through planted symlinks (issue 15): a symlinked rank directory (to another run inside the
root, to a directory outside it) or a symlinked shard file never makes retention delete anything
outside the run; the refused step keeps its rows and says why. Real daemon, real files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from sqlalchemy.orm import sessionmaker

from ckptd.catalog.db import make_engine
from ckptd.policy import RetentionPolicy
from ckptd.service import retention
from ckptd.storage import PosixStorage
from tests.daemon_helpers import query, save_shard, started_daemon, wait_for, write_tp_strategy

RUNS = ("victim", "run7", "run8", "run9")


def _verified(url: str) -> int:
    return query(url, "SELECT count(*) FROM checkpoints WHERE state = 'verified'")[0][0]


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() or p.is_symlink())


@pytest.mark.timeout(120)
def test_gc_never_deletes_through_a_symlink(ms, tmp_path, catalog_url):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    for run in RUNS:
        write_tp_strategy(root / run)
        for rank in range(2):
            for step in (1, 2, 3):
                save_shard(ms, root, run, rank, step)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: _verified(catalog_url) == 12, 60, what="every step verified")
    finally:
        d.stop()
    # the links are planted behind the daemon's back (a running daemon would mark the swapped
    # steps corrupt first, tests/test_swapped_shards.py, and which steps gc deletes would race it):
    # gc alone must refuse every path through them
    engine = make_engine(catalog_url)
    sessions = sessionmaker(engine, expire_on_commit=False)
    try:
        # run7's rank directory -> another run's (inside the root); run8's -> a directory outside
        shutil.move(root / "run7" / "rank_0", tmp_path / "run7_rank0_moved")
        os.symlink(root / "victim" / "rank_0", root / "run7" / "rank_0")
        shutil.copytree(root / "run8" / "rank_0", outside / "rank_0")
        shutil.rmtree(root / "run8" / "rank_0")
        os.symlink(outside / "rank_0", root / "run8" / "rank_0")
        # run9's oldest shard of rank 1 -> a file outside
        shutil.copy(root / "run9" / "rank_1" / "net-1_1.ckpt", outside / "secret.ckpt")
        os.unlink(root / "run9" / "rank_1" / "net-1_1.ckpt")
        os.symlink(outside / "secret.ckpt", root / "run9" / "rank_1" / "net-1_1.ckpt")
        victim_before, outside_before = _files(root / "victim"), _files(outside)
        for run in ("run7", "run8", "run9"):
            retention.gc(sessions, PosixStorage(str(root)), RetentionPolicy(keep_last=1), run_name=run)
    finally:
        engine.dispose()
    assert _files(root / "victim") == victim_before  # nothing of another run deleted
    assert _files(outside) == outside_before  # nothing outside the root deleted
    assert os.path.islink(root / "run9" / "rank_1" / "net-1_1.ckpt")  # the planted link is left for an operator
    kept = query(catalog_url, "SELECT r.name, c.step, c.state, c.reason FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                              "WHERE c.state = 'deleting' ORDER BY r.name, c.step")
    refused = {(run, step) for run, step, _, _ in kept}
    assert {("run7", 1), ("run7", 2), ("run8", 1), ("run8", 2), ("run9", 1)} <= refused
    for run, step, _, reason in kept:  # rows kept, each saying why
        assert reason and "symlink" in reason and "not deleted" in reason, (run, step, reason)
    # the files gc could delete were deleted: run9's step 2 had no link in it
    assert not (root / "run9" / "rank_0" / "net-1_2.ckpt").exists()
