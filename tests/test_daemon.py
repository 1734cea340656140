"""The daemon against real MindSpore saves: every case ends with the catalog telling the truth.

Runs on embedded SQLite and on the real PostgreSQL (``catalog_url`` fixture).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from ckptd.catalog.db import SchemaMismatchError, make_engine
from ckptd.daemon import Daemon
from ckptd.settings import Settings
from ckptd.states import ShardState
from tests.daemon_helpers import (
    query,
    rank_tensors,
    save_shard,
    start_daemon_process,
    step_states,
    wait_for,
    wait_for_rescans,
    write_tp_strategy,
)


@pytest.fixture
def daemon(root, catalog_url):
    d = Daemon(Settings(root=root, db=catalog_url, settle_seconds=0.2, rescan_interval=0.5, debounce=0.02))
    d.start()
    yield d
    d.stop()


def _settled(d: Daemon, url: str, want: dict[int, str], timeout: float = 30) -> None:
    def check():
        d.verifier.drain(timeout=10)
        got = step_states(url)
        return got if got == want else None

    wait_for(check, timeout, what=f"step states {want}")


def _run_daemon_until(root: Path, url: str, want: dict[int, str], **settings) -> None:
    """Start a daemon, wait for the step states, stop it (also when the wait fails)."""
    d = Daemon(Settings(root=root, db=url, **{"settle_seconds": 0.2, "rescan_interval": 0.5, "debounce": 0.02, **settings}))
    d.start()
    try:
        _settled(d, url, want)
    finally:
        d.stop()


def test_steps_become_verified_with_evidence(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1")
    for step in (100, 200):
        for rank in range(2):
            save_shard(ms, root, "run1", rank, step)
    _settled(daemon, catalog_url, {100: "verified", 200: "verified"})
    rows = query(catalog_url, "SELECT step, global_step, expected_ranks, reason FROM checkpoints ORDER BY step")
    assert rows == [(100, 100, 2, None), (200, 200, 2, None)]
    shards = query(catalog_url, "SELECT rank, state, crc, digest IS NOT NULL, quarantined FROM shards ORDER BY path")
    assert all(s == "verified" and crc == "valid" and has_digest and not q for _, s, crc, has_digest, q in shards)
    assert len(shards) == 4
    events = query(catalog_url, "SELECT kind, outcome FROM verification_events")
    assert events.count(("shard", "verified")) == 4 and events.count(("step", "ok")) == 2


def test_missing_rank_keeps_step_incomplete_until_it_arrives(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1")
    save_shard(ms, root, "run1", 0, 100)
    _settled(daemon, catalog_url, {100: "incomplete"})
    save_shard(ms, root, "run1", 1, 100)
    _settled(daemon, catalog_url, {100: "verified"})


def test_truncated_and_bitflipped_shards_are_quarantined_not_deleted(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1")
    for step in (100, 200):
        for rank in range(2):
            save_shard(ms, root, "run1", rank, step)
    _settled(daemon, catalog_url, {100: "verified", 200: "verified"})
    # a torn copy replaces rank 1 of step 200 (new inode, as a re-save would)
    victim = root / "run1" / "rank_1" / "net-1_200.ckpt"
    data = victim.read_bytes()
    torn = victim.with_suffix(".partial")
    torn.write_bytes(data[: len(data) // 2])
    os.replace(torn, victim)
    # one bit flips in place in rank 0 of step 100 (same inode, new mtime)
    rotten = root / "run1" / "rank_0" / "net-1_100.ckpt"
    os.chmod(rotten, 0o600)
    with open(rotten, "r+b") as fh:
        fh.seek(60)
        byte = fh.read(1)
        fh.seek(60)
        fh.write(bytes([byte[0] ^ 0x04]))
    _settled(daemon, catalog_url, {100: "corrupt", 200: "corrupt"})
    bad = dict(query(catalog_url, "SELECT path, error_code FROM shards WHERE quarantined"))
    assert bad == {str(victim): "truncated", str(rotten): "checksum_mismatch"}
    assert victim.exists() and rotten.exists()  # quarantined in place, never deleted


def test_shape_that_contradicts_the_strategy_fails_the_step(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1")
    save_shard(ms, root, "run1", 0, 100)
    wrong = rank_tensors(1, 100)
    wrong["w"] = np.zeros((3, 4), np.float32)  # the strategy says rank 1 holds rows 4..8 (4 x 4)
    save_shard(ms, root, "run1", 1, 100, tensors=wrong)
    _settled(daemon, catalog_url, {100: "corrupt"})
    (reason,) = query(catalog_url, "SELECT reason FROM checkpoints")[0]
    assert "rank 1" in reason and "'w'" in reason


def test_swapped_shards_are_caught(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1")
    save_shard(ms, root, "run1", 0, 100, tensors=rank_tensors(1, 100), rank_id=1)
    save_shard(ms, root, "run1", 1, 100, tensors=rank_tensors(0, 100), rank_id=0)
    _settled(daemon, catalog_url, {100: "corrupt"})
    (reason,) = query(catalog_url, "SELECT reason FROM checkpoints")[0]
    assert "swapped" in reason


def test_replicas_that_disagree_are_caught(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1")
    save_shard(ms, root, "run1", 0, 100)
    diverged = rank_tensors(1, 100)
    diverged["b"] = diverged["b"] + 1  # "b" is replicated on both ranks: must be identical
    save_shard(ms, root, "run1", 1, 100, tensors=diverged)
    _settled(daemon, catalog_url, {100: "corrupt"})
    (reason,) = query(catalog_url, "SELECT reason FROM checkpoints")[0]
    assert "replicas of 'b' differ" in reason


def test_step_mixing_two_saves_is_caught(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1")
    save_shard(ms, root, "run1", 0, 200)
    path = save_shard(ms, root, "run1", 1, 100)
    shutil.copy(path, root / "run1" / "rank_1" / "net-1_200.ckpt")  # an old shard renamed into the new step
    _settled(daemon, catalog_url, {100: "incomplete", 200: "corrupt"})
    reason = dict(query(catalog_url, "SELECT step, reason FROM checkpoints"))[200]
    assert "disagree on the global step" in reason


def test_rotation_and_renames_mark_steps_deleted_and_keep_rows(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1")
    for step in (100, 200):
        for rank in range(2):
            save_shard(ms, root, "run1", rank, step)
    _settled(daemon, catalog_url, {100: "verified", 200: "verified"})
    for rank in range(2):  # keep_checkpoint_max rotation
        (root / "run1" / f"rank_{rank}" / "net-1_100.ckpt").unlink()
    src = root / "run1" / "rank_0" / "net-1_200.ckpt"
    src.rename(src.with_name("net-1_300.ckpt"))  # an operator renames a shard
    _settled(daemon, catalog_url, {100: "deleted", 200: "deleted", 300: "incomplete"})
    assert query(catalog_url, "SELECT count(*) FROM shards")[0][0] == 5


def test_temp_and_growing_files_are_never_shards(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1")
    rank_dir = root / "run1" / "rank_0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "net-1_100.tmp").write_bytes(b"\x0a\x05partial")
    growing = rank_dir / "net-1_100.ckpt"
    with open(growing, "wb") as fh:  # writable and fresh: not settled yet
        fh.write(b"\x0a")
        time.sleep(0.05)
        assert query(catalog_url, "SELECT count(*) FROM shards")[0][0] == 0
    growing.unlink()
    save_shard(ms, root, "run1", 0, 100)
    save_shard(ms, root, "run1", 1, 100)
    _settled(daemon, catalog_url, {100: "verified"})
    assert [p for (p,) in query(catalog_url, "SELECT path FROM shards") if p.endswith(".tmp")] == []


WRITER = textwrap.dedent(
    """
    import sys, numpy as np, mindspore as ms
    big = np.ones((64, 1 << 20), np.float32)  # 256 MiB: the save takes long enough to be killed mid-way
    ms.save_checkpoint([{"name": "w", "data": ms.Tensor(big)}], sys.argv[1], append_dict={"step_num": 100})
    """
)


@pytest.mark.slow
def test_writer_killed_mid_save_leaves_no_shard(ms, root, catalog_url, daemon):
    rank_dir = root / "run1" / "rank_0"
    rank_dir.mkdir(parents=True)
    final = rank_dir / "net-1_100.ckpt"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(final)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = rank_dir / "net-1_100.tmp"
    wait_for(lambda: tmp.exists() and tmp.stat().st_size > 0, 120, what="the writer's .tmp file")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not final.exists()
    wait_for_rescans(daemon)  # a whole rescan after the kill listed the torn .tmp
    daemon.verifier.drain(timeout=10)
    assert query(catalog_url, "SELECT count(*) FROM shards")[0][0] == 0
    assert tmp.exists()  # ckptd never touches the writer's leftovers


@pytest.mark.slow
def test_daemon_killed_during_ingest_converges_after_restart(ms, root, catalog_url, tmp_path):
    write_tp_strategy(root / "run1")
    steps = list(range(10, 130, 10))
    for step in steps:
        for rank in range(2):
            save_shard(ms, root, "run1", rank, step)
    log = tmp_path / "daemon.log"
    first = start_daemon_process(root, catalog_url, log=log)
    wait_for(lambda: query(catalog_url, "SELECT count(*) FROM shards")[0][0] > 0, 60, 0.01, "ingest to begin")
    first.send_signal(signal.SIGKILL)
    first.wait()
    partial = query(catalog_url, "SELECT count(*) FROM shards")[0][0]
    second = start_daemon_process(root, catalog_url, log=log)
    try:
        wait_for(lambda: set(step_states(catalog_url).values()) == {"verified"} and len(step_states(catalog_url)) == len(steps),
                 90, 0.2, "all steps verified after restart")
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    assert partial <= 2 * len(steps)
    assert query(catalog_url, "SELECT count(*), count(DISTINCT path) FROM shards")[0] == (2 * len(steps), 2 * len(steps))


@pytest.mark.slow
def test_two_daemons_on_one_postgres_catalog(ms, root, tmp_path):
    from ckptd.catalog.db import upgrade
    from tests.conftest import fresh_pg_database

    url, drop = fresh_pg_database()
    try:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        write_tp_strategy(root / "run1")
        daemons = [start_daemon_process(root, url, log=tmp_path / f"d{i}.log") for i in range(2)]
        try:
            for step in range(10, 110, 10):
                for rank in range(2):
                    save_shard(ms, root, "run1", rank, step)
            wait_for(lambda: len(step_states(url)) == 10 and set(step_states(url).values()) == {"verified"}, 90, 0.2,
                     "both daemons to settle")
        finally:
            for d in daemons:
                d.send_signal(signal.SIGTERM)
            for d in daemons:
                assert d.wait(30) == 0
        assert query(url, "SELECT count(*), count(DISTINCT path) FROM shards")[0] == (20, 20)
        assert query(url, "SELECT count(*) FROM checkpoints")[0][0] == 10
        assert query(url, "SELECT count(*) FROM runs")[0][0] == 1
    finally:
        drop()


def test_daemon_refuses_unmigrated_and_newer_catalogs(root, tmp_path, catalog_url):
    with pytest.raises(SchemaMismatchError, match="no ckptd schema"):
        Daemon(Settings(root=root, db=f"sqlite:///{tmp_path / 'empty.db'}"))
    engine = make_engine(catalog_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    engine.dispose()
    with pytest.raises(SchemaMismatchError, match="newer than this ckptd knows"):
        Daemon(Settings(root=root, db=catalog_url))


def test_sidecar_commit_hint_is_checked(ms, root, catalog_url, daemon):
    import json

    import xxhash

    write_tp_strategy(root / "run1")
    for rank in range(2):
        path = save_shard(ms, root, "run1", rank, 100)
        data = path.read_bytes()
        digest = xxhash.xxh3_128(data).hexdigest() if rank == 0 else "0" * 32  # rank 1's hint disagrees
        (path.parent / (path.name + ".done")).write_text(json.dumps({"size": len(data), "xxh3_128": digest}))
    daemon.ingestor.rescan()
    _settled(daemon, catalog_url, {100: "corrupt"})
    codes = dict(query(catalog_url, "SELECT rank, error_code FROM shards"))
    assert codes == {0: None, 1: "sidecar_mismatch"}


def test_strategy_overwritten_by_a_new_layout_keeps_old_steps_valid(ms, root, catalog_url, daemon):
    write_tp_strategy(root / "run1", tp=2)
    for rank in range(2):
        save_shard(ms, root, "run1", rank, 100)
    _settled(daemon, catalog_url, {100: "verified"})
    (root / "run1" / "strategy.ckpt").unlink()
    write_tp_strategy(root / "run1", tp=4)  # the job restarted on 4 ranks and rewrote its strategy file
    daemon.ingestor.rescan()
    for rank in range(4):
        save_shard(ms, root, "run1", rank, 200, tensors=rank_tensors(rank, 200, tp=4))
    _settled(daemon, catalog_url, {100: "verified", 200: "verified"})
    (ckpt_id,) = query(catalog_url, "SELECT id FROM checkpoints WHERE step = 100")[0]
    assert daemon.verifier.check_step(ckpt_id) == []  # re-checked against the layout it was saved with
    assert dict(query(catalog_url, "SELECT step, expected_ranks FROM checkpoints")) == {100: 2, 200: 4}
    assert query(catalog_url, "SELECT count(*) FROM strategy_files")[0][0] == 2


def test_scrub_finds_bit_rot_that_keeps_size_and_mtime(ms, root, catalog_url):
    """A rescan cannot see in-place corruption that keeps size, mtime and inode; the background
    scrub re-reads verified shards and compares them with the digest taken at ingest."""
    write_tp_strategy(root / "run1")
    for rank in range(2):
        save_shard(ms, root, "run1", rank, 100)
    rotten = root / "run1" / "rank_1" / "net-1_100.ckpt"
    _run_daemon_until(root, catalog_url, {100: "verified"})
    st = os.stat(rotten)
    os.chmod(rotten, 0o600)
    with open(rotten, "r+b") as fh:  # flip a bit inside a tensor payload, then restore the mtime
        fh.seek(st.st_size // 2)
        byte = fh.read(1)
        fh.seek(st.st_size // 2)
        fh.write(bytes([byte[0] ^ 0x01]))
    os.chmod(rotten, 0o400)
    os.utime(rotten, ns=(st.st_atime_ns, st.st_mtime_ns))
    # without a scrub the daemon trusts the catalogued verdict: nothing it can see has changed
    quiet = Daemon(Settings(root=root, db=catalog_url, settle_seconds=0.2, rescan_interval=0.5, debounce=0.02))
    quiet.start()
    try:
        assert quiet.wait_idle(timeout=30)
        assert step_states(catalog_url) == {100: "verified"}
    finally:
        quiet.stop()
    _run_daemon_until(root, catalog_url, {100: "corrupt"}, scrub_interval=1.0)
    bad = query(catalog_url, "SELECT path, error_code, quarantined FROM shards WHERE state = 'corrupt'")
    assert len(bad) == 1 and bad[0][0] == str(rotten) and bad[0][2]
    assert bad[0][1] in ("content_changed", "checksum_mismatch")
    assert rotten.exists()  # quarantined in place


def test_step_whose_checks_never_ran_is_checked_after_restart(ms, root, catalog_url):
    """A crash after a step's last shard was verified but before its step checks ran leaves it
    'pending' with every shard settled; the next start's rescan must finish the job."""
    write_tp_strategy(root / "run1")
    for rank in range(2):
        save_shard(ms, root, "run1", rank, 100)
    _run_daemon_until(root, catalog_url, {100: "verified"}, rescan_interval=30)
    engine = make_engine(catalog_url)
    with engine.begin() as conn:  # the state that crash leaves behind
        conn.exec_driver_sql("UPDATE checkpoints SET state = 'pending', step_checks_ok = NULL, global_step = NULL")
    engine.dispose()
    _run_daemon_until(root, catalog_url, {100: "verified"}, rescan_interval=30)
    assert query(catalog_url, "SELECT step_checks_ok, global_step FROM checkpoints") == [(True, 100)]


def test_step_checks_asked_for_concurrently_run_once(ms, root, catalog_url):
    """The last shards of a step finish together, a rescan may ask as well, and a re-verification
    job checks on its own thread: however many callers ask at once — through the queue (one
    worker per checkpoint) or directly — the step is checked once and ends verified (one verdict,
    one event; the rest find it judged under the step's row lock)."""
    import threading

    from sqlalchemy.orm import sessionmaker

    from ckptd.format.index_cache import IndexCache
    from ckptd import daemon as compose
    from ckptd.catalog.nodes import NodeView

    write_tp_strategy(root / "run1")
    for rank in range(2):
        save_shard(ms, root, "run1", rank, 100)
    _run_daemon_until(root, catalog_url, {100: "verified"}, rescan_interval=30)
    engine = make_engine(catalog_url)
    with engine.begin() as conn:  # every shard verified, the step checks not run yet
        conn.exec_driver_sql("UPDATE checkpoints SET state = 'pending', step_checks_ok = NULL")
        conn.exec_driver_sql("DELETE FROM verification_events WHERE kind = 'step'")
    ((ckpt_id,),) = query(catalog_url, "SELECT id FROM checkpoints")
    settings, sessions = Settings(root=root, db=catalog_url), sessionmaker(engine, expire_on_commit=False)
    verifier = compose.verifier(settings, sessions, NodeView(sessions, settings.node_name, settings.node_timeout),
                               IndexCache())
    start = threading.Barrier(8)

    def ask(i: int) -> None:
        start.wait()
        verifier.submit_step(ckpt_id) if i % 2 else verifier.check_step_if_due(ckpt_id)

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    try:
        for t in askers:
            t.start()
        for t in askers:
            t.join(60)
        verifier.drain(timeout=60)
    finally:
        verifier.close()
        engine.dispose()
    assert step_states(catalog_url) == {100: "verified"}
    assert query(catalog_url, "SELECT outcome FROM verification_events WHERE kind = 'step'") == [("ok",)]


def test_a_new_shard_is_parsed_once_and_a_re_verification_reads_its_records_again(ms, root, catalog_url, daemon,
                                                                                  monkeypatch):
    """Ingest, the first verification and the step check share one parse of a new plaintext shard
    (the index cache: same inode, size, mtime and ctime, so the same bytes); a later verification,
    a scrub's, parses the records from the bytes again, since damage below the file system leaves
    all of those unchanged."""
    from datetime import datetime, timedelta, timezone

    from ckptd.format import checkpoint

    parsed: list[str] = []
    index_ckpt = checkpoint.ckpt_fmt.index_ckpt

    def counting(source, **kw):
        parsed.append(source.path)
        return index_ckpt(source, **kw)

    monkeypatch.setattr(checkpoint.ckpt_fmt, "index_ckpt", counting)
    write_tp_strategy(root / "run1")
    for rank in range(2):
        save_shard(ms, root, "run1", rank, 100)
    _settled(daemon, catalog_url, {100: "verified"})
    assert len(parsed) == 2  # each shard's records parsed once, at ingest
    assert daemon.verifier.index_cache.hits >= 4  # reused by its verification and by the step check
    ids = [sid for (sid,) in query(catalog_url, "SELECT id FROM shards ORDER BY id")]
    later = datetime.now(timezone.utc) + timedelta(seconds=1)
    outcome = daemon.verifier.verify_shards(ids, asks=dict.fromkeys(ids, later))  # a scrub's ask
    assert set(outcome.values()) == {ShardState.VERIFIED}
    assert len(parsed) == 4  # the re-verification read the records from the bytes
    assert query(catalog_url, "SELECT count(*) FROM verification_events WHERE kind = 'shard'") == [(4,)]
