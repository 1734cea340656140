"""A FIFO reached by a conversion — a verified source shard swapped for one, or an admin's
``to_strategy`` naming one inside the root — fails the conversion with a clear reason instead of
blocking the job thread in open() forever (issue 15). Real files; a hang fails by the timeout."""

from __future__ import annotations

import os

import pytest
from sqlalchemy.orm import sessionmaker

from ckptd.split import parse_split
from ckptd.storage import ConfinementError, PosixStorage
from ckptd.catalog.db import make_engine
from ckptd.daemon import Daemon
from ckptd.service.conversions import convert_step
from tests.daemon_helpers import fast_settings, query, save_tp_step, started_daemon, step_states, wait_for


@pytest.mark.timeout(120)
def test_fifos_fail_a_conversion_instead_of_blocking_it(ms, tmp_path, catalog_url):
    root = tmp_path / "root"
    save_tp_step(ms, root, "run", 2)
    settings = fast_settings(root, catalog_url)
    d = Daemon(settings)
    d.start()
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step verified")
        os.mkfifo(root / "run" / "target.ckpt")
        with pytest.raises(ConfinementError, match="FIFO"):
            convert_step(d.sessions, PosixStorage(str(root)), "run", 2, to_strategy=str(root / "run" / "target.ckpt"))
    finally:
        d.stop()
    # the source swapped while nobody watched (the catalog still says verified): the conversion
    # must refuse it, not open it by name
    tmp = root / "run" / "rank_0" / "tmp"
    os.mkfifo(tmp)
    os.replace(tmp, root / "run" / "rank_0" / "net-1_2.ckpt")
    engine = make_engine(catalog_url)  # sessions only: nothing watching, as between the check and the open
    try:
        with pytest.raises(ConfinementError, match="FIFO"):
            convert_step(sessionmaker(engine, expire_on_commit=False), PosixStorage(str(root)), "run", 2, split=parse_split("tp=1,dp=1"))
    finally:
        engine.dispose()
    assert query(catalog_url, "SELECT state FROM conversion_jobs") in ([], [("failed",)])


@pytest.mark.timeout(120)
def test_a_fifo_outside_the_root_named_by_the_operator_is_refused_not_waited_on(ms, tmp_path, catalog_url):
    """``ckptd convert --run --to-strategy`` may name a file outside the root (the operator's own);
    a FIFO there blocked the CLI in open() forever."""
    import subprocess
    import sys

    root = tmp_path / "root"
    save_tp_step(ms, root, "run", 2)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step verified")
    finally:
        d.stop()
    fifo = tmp_path / "target_strategy.ckpt"
    os.mkfifo(fifo)
    env = dict(os.environ, CKPTD_DB=catalog_url, CKPTD_ROOT=str(root))
    proc = subprocess.run([sys.executable, "-m", "ckptd", "convert", "--run", "run", "--step", "2", "--to-strategy",
                           str(fifo)], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0 and "not a regular file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
