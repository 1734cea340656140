"""The memory tier's daemon side (ckptd/service/memtier.py) on a hostile memory root: a slot cut
short is a recorded refusal, never a SIGBUS of the daemon."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from sqlalchemy.orm import sessionmaker

from ckptd.catalog.db import make_engine, upgrade
from ckptd.integrations.flash import FlashWriter, load_into
from ckptd.service.memtier import MemoryTier
from ckptd.storage import PosixStorage, memslot


@pytest.fixture
def make_tier(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'catalog.db'}")
    upgrade(engine)
    (tmp_path / "root").mkdir()
    shm = tmp_path / "shm"
    shm.mkdir()
    yield lambda **kw: MemoryTier(sessionmaker(engine, expire_on_commit=False), PosixStorage(str(tmp_path / "root")),
                                  str(shm), "node1", **kw)
    engine.dispose()


class Clock:
    """A monotonic clock the test moves: a failing region's back-off passes when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tier(make_tier):
    return make_tier(clock=Clock())


def _state(seed: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [("w", rng.standard_normal((256, 129)).astype(np.float32)), ("b", np.arange(7, dtype=np.int64))]


def _writer(tier: MemoryTier, rank: int = 0, run: str = "run1") -> FlashWriter:
    run_dir = os.path.join(tier.store.root, run)
    os.makedirs(os.path.join(run_dir, f"rank_{rank}"), exist_ok=True)
    return FlashWriter(run_dir, rank, 1, root=tier.root)


def _snapshot(w: FlashWriter, step: int) -> list[tuple[str, np.ndarray]]:
    state = _state(step)
    w.snapshot(step, 1, f"rank_{w.rank}/net-1_{step}.ckpt", state, [("step_num", step)])
    w.wait()
    return state


def _committed(w: FlashWriter) -> str:
    snap = memslot.newest(w.paths, uid=os.geteuid())
    assert snap is not None
    snap.close()
    return snap.path


def test_a_truncated_committed_slot_is_a_recorded_refusal_and_the_scan_goes_on(tier, caplog):
    w = _writer(tier)
    try:
        _snapshot(w, 10)
        path = _committed(w)
        with open(path, "rb") as fh:
            h = memslot.read_header(fh.read(memslot.PAGE), path)
        size = h.payload_off + h.payload_len
        os.truncate(path, memslot.PAGE * 2)  # the header and table stay; the payload is cut
        with caplog.at_level(logging.WARNING, logger="ckptd.memory"):
            assert tier.scan() == 0
            assert tier.scan() == 0  # logged once, still running
        refusals = [r.getMessage() for r in caplog.records if "slot truncated" in r.getMessage()]
        assert len(refusals) == 1 and f"header says {size} bytes, file has {memslot.PAGE * 2}" in refusals[0]
        assert tier.seen[path].ckpt_id is None  # seen, not catalogued
        with pytest.raises(memslot.SlotError, match="slot truncated"):
            load_into(path, {n: np.zeros_like(a) for n, a in _state(10)})
        # the job goes on: its next snapshot (into the other slot) is catalogued
        _snapshot(w, 11)
        tier.clock.now += 61  # past the failing region's back-off
        assert tier.scan() == 1
    finally:
        w.release()


def test_a_slot_truncated_between_the_header_and_the_payload_read_is_a_slot_error(tier):
    w = _writer(tier)
    try:
        _snapshot(w, 20)
        path = _committed(w)
        snap = memslot.open_snapshot(path, uid=os.geteuid())  # header and table read
        try:
            os.truncate(path, memslot.PAGE + 100)  # a mapping of it would SIGBUS here
            with pytest.raises(memslot.SlotError, match="slot truncated: header says"):
                snap.verify()
            with pytest.raises(memslot.SlotError, match="slot truncated"):
                snap.read_tensor(snap.table.entries[0])
        finally:
            snap.close()
        # the daemon's scan of the cut slot: a refusal, the daemon still here
        assert tier.scan() == 0 and path in tier.seen
    finally:
        w.release()


def test_a_symlinked_rank_dir_is_refused_and_nothing_behind_it_is_read_or_removed(tier, tmp_path, caplog):
    # valid slots of a real run, outside the memory root; a region whose rank_0 points at them
    w = FlashWriter(os.path.join(tier.store.root, "run1"), 0, 1, root=str(tmp_path / "elsewhere"))
    os.makedirs(os.path.join(tier.store.root, "run1", "rank_0"), exist_ok=True)
    try:
        _snapshot(w, 5)
        region = os.path.join(tier.root, memslot.run_key(os.path.join(tier.store.root, "run1")))
        os.mkdir(region, 0o700)
        os.symlink(w.dir, os.path.join(region, "rank_0"))
        before = {p: os.stat(p).st_size for p in w.paths if os.path.exists(p)}
        assert before
        tier.release_after = -1.0  # every region is released at its first scan
        with caplog.at_level(logging.WARNING, logger="ckptd.memory"):
            assert tier.scan() == 0
            tier.scan()
        refused = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
        assert len(refused) == 1 and "rank_0" in refused[0]
        assert not tier.seen
        assert {p: os.stat(p).st_size for p in before} == before  # not removed through the link
        assert not os.path.lexists(region)  # the region itself (with its link) released
    finally:
        w.release()


def test_a_symlinked_region_is_refused(tier, tmp_path, caplog):
    w = FlashWriter(os.path.join(tier.store.root, "run1"), 0, 1, root=str(tmp_path / "elsewhere"))
    os.makedirs(os.path.join(tier.store.root, "run1", "rank_0"), exist_ok=True)
    try:
        _snapshot(w, 5)
        slot = _committed(w)
        os.symlink(os.path.dirname(w.dir), os.path.join(tier.root, memslot.run_key(os.path.join(tier.store.root, "run1"))))
        with caplog.at_level(logging.WARNING, logger="ckptd.memory"):
            assert tier.scan() == 0
        assert any("symbolic link" in r.getMessage() for r in caplog.records) and not tier.seen
        assert os.path.exists(slot)
    finally:
        w.release()


def test_a_released_region_with_a_link_to_outside_leaves_the_outside_untouched(tier, outside):
    (outside / "keep").mkdir()
    (outside / "keep" / "precious").write_bytes(b"x")
    w = _writer(tier)
    try:
        _snapshot(w, 7)
        assert tier.scan() == 1
        os.symlink(outside / "keep", os.path.join(w.dir, "link"))
        os.symlink(outside / "keep" / "precious", os.path.join(os.path.dirname(w.dir), "file_link"))
        tier.release_after = -1.0
        tier.scan()
        assert not os.path.lexists(os.path.dirname(w.dir))  # released
        assert (outside / "keep" / "precious").read_bytes() == b"x"  # nothing followed
        assert not tier.seen
    finally:
        w.release()


def test_a_slot_of_another_mode_or_a_group_writable_rank_dir_is_refused(tier, caplog):
    w = _writer(tier)
    try:
        _snapshot(w, 8)
        path = _committed(w)
        os.chmod(path, 0o644)
        with caplog.at_level(logging.WARNING, logger="ckptd.memory"):
            assert tier.scan() == 0
            tier.scan()
        assert len([r for r in caplog.records if "mode 0644" in r.getMessage()]) == 1
        os.chmod(path, 0o600)
        os.chmod(w.dir, 0o770)
        tier.clock.now += 61
        with caplog.at_level(logging.WARNING, logger="ckptd.memory"):
            assert tier.scan() == 0
        assert any("mode 0770" in r.getMessage() for r in caplog.records)
        os.chmod(w.dir, 0o700)
    finally:
        w.release()


def test_a_failing_region_backs_off_doubling_to_a_minute_and_a_healthy_one_keeps_the_cadence(make_tier):
    now = [0.0]
    tier = make_tier(clock=lambda: now[0])
    bad, good = _writer(tier, run="run1"), _writer(tier, run="run2")
    try:
        _snapshot(bad, 10)
        os.chmod(_committed(bad), 0o644)  # refused: a slot others may read
        _snapshot(good, 10)
        key, ok = os.path.basename(os.path.dirname(bad.dir)), os.path.basename(os.path.dirname(good.dir))
        assert tier.scan() == 1 and tier.backoff == {key: (1.0, 1.0)}
        now[0] = 0.5
        assert tier.scan() == 0 and tier.backoff == {key: (1.0, 1.0)}  # not looked at yet
        delays = []
        while now[0] < 200:
            now[0] = tier.backoff[key][0]
            tier.scan()
            delays.append(tier.backoff[key][1])
        assert delays[:7] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0] and set(delays[5:]) == {60.0}
        assert ok not in tier.backoff
        # the healthy region keeps the scan's cadence; the failing one, backing off, still has its
        # commit words read: a new snapshot there is catalogued at once and resets the back-off
        now[0] += 1.0
        _snapshot(good, 11)
        _snapshot(bad, 11)
        assert tier.scan() == 2 and ok not in tier.backoff  # both: bad's commit word moved
        assert tier.backoff[key] == (now[0] + 1.0, 1.0)  # reset: slot_0 is still refused
        before = tier.backoff[key]
        now[0] += 0.5
        assert tier.scan() == 0 and tier.backoff[key] == before  # nothing moved: the delay runs on
    finally:
        bad.release()
        good.release()


def test_a_memory_root_wiped_whole_forgets_what_it_held(tier):
    import shutil

    w = _writer(tier)
    try:
        _snapshot(w, 3)
        assert tier.scan() == 1 and tier.seen
        shutil.rmtree(tier.root)  # the node rebooted, or /dev/shm was cleared
        assert tier.scan() == 0 and not tier.seen and tier.idle
    finally:
        w.release()


def test_at_start_a_copy_is_kept_only_if_its_slot_reached_without_links_still_holds_it(make_tier, tmp_path):
    first = make_tier(clock=Clock())
    w = _writer(first)
    try:
        _snapshot(w, 4)
        path = _committed(w)
        assert first.scan() == 1
        again = make_tier(clock=Clock())
        again.reconcile()  # the daemon restarted: the slot still holds the copy
        assert again.seen[path].ckpt_id == first.seen[path].ckpt_id
        # the region moved away and a link left in its place: the copy is not kept through it
        region = os.path.dirname(w.dir)
        os.rename(region, str(tmp_path / "moved"))
        os.symlink(str(tmp_path / "moved"), region)
        third = make_tier(clock=Clock())
        third.reconcile()
        assert path not in third.seen
        os.unlink(region)
        os.rename(str(tmp_path / "moved"), region)
    finally:
        w.release()
