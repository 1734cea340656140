"""The watcher's event sources against the real kernel: what a path event promises, and that lost
events end in a rescan. The daemon tests rescan every 0.5 s, which would hide a deaf event source;
here rescans are (almost) off, so only events can find a new save."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from ckptd.daemon import Daemon
from ckptd.inotify import InotifyTree
from ckptd.settings import Settings
from ckptd.watcher import wanted_name
from tests.daemon_helpers import migrated_sqlite, query, save_shard, step_states, wait_for, write_tp_strategy

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/sys/fs/inotify"), reason="Linux inotify")


class _Recorder:
    def __init__(self) -> None:
        self.paths: list[str] = []
        self.lost: list[str] = []
        self._lock = threading.Lock()

    def on_paths(self, paths: list[str]) -> None:
        with self._lock:
            self.paths += paths

    def on_lost(self, why: str) -> None:
        with self._lock:
            self.lost.append(why)

    def seen(self, path: Path) -> bool:
        with self._lock:
            return str(path) in self.paths


@pytest.fixture
def tree(tmp_path):
    rec = _Recorder()
    t = InotifyTree(str(tmp_path), rec.on_paths, rec.on_lost, wanted=wanted_name)
    t.open()
    yield t, rec
    t.close()


def test_a_save_is_reported_at_its_final_name_only(tree, tmp_path):
    t, rec = tree
    t.start()
    rank = tmp_path / "run" / "rank_0"
    rank.mkdir(parents=True)
    tmp, final = rank / "net-1_5.tmp", rank / "net-1_5.ckpt"
    tmp.write_bytes(b"x" * 100)  # MindSpore: write the .tmp, rename, chmod 0400
    os.rename(tmp, final)
    os.chmod(final, 0o400)
    wait_for(lambda: rec.seen(final), 10, what="the final name")
    final.unlink()
    wait_for(lambda: rec.paths.count(str(final)) >= 2, 10, what="the deletion")
    assert not [p for p in rec.paths if p.endswith(".tmp")], "in-flight names are filtered out"
    assert rec.lost == []


def test_files_written_before_their_new_directory_was_watched_are_reported(tree, tmp_path):
    t, rec = tree
    # the tree grows while nobody reads events: the watch of run/ is added only when its
    # IN_CREATE is handled, after rank_3/ and the shard exist
    shard = tmp_path / "run" / "rank_3" / "net-1_1.ckpt"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"y")
    t.start()
    wait_for(lambda: rec.seen(shard), 10, what="a file inside a directory created before its watch")
    later = tmp_path / "run" / "rank_3" / "net-1_2.ckpt"  # and the new directories are watched
    later.write_bytes(b"z")
    wait_for(lambda: rec.seen(later), 10, what="a file in the newly watched directory")


def test_a_directory_moved_away_asks_for_a_rescan(tree, tmp_path):
    t, rec = tree
    (tmp_path / "run" / "rank_0").mkdir(parents=True)
    t.start()
    wait_for(lambda: t.watched == 3, 10, what="watches on run/ and rank_0/")
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    shutil.move(str(tmp_path / "run"), str(outside))
    try:
        wait_for(lambda: rec.lost, 10, what="on_lost")
        assert "moved away" in rec.lost[0]
        wait_for(lambda: t.watched == 1, 10, what="the moved directories' watches dropped")
    finally:
        shutil.rmtree(outside)


def test_a_directory_recreated_while_its_old_inode_is_held_open_is_watched_again(tree, tmp_path):
    t, rec = tree
    rank = tmp_path / "run" / "rank_0"
    rank.mkdir(parents=True)
    old = rank / "net-1_1.ckpt"
    old.write_bytes(b"a")
    t.start()
    with open(old, "rb"):  # e.g. the verifier reading it: the old inodes outlive the rmtree
        shutil.rmtree(tmp_path / "run")
        rank.mkdir(parents=True)
        new = rank / "net-1_2.ckpt"
        new.write_bytes(b"b")
        wait_for(lambda: rec.seen(new), 10, what="a file in the re-created directory")
    later = rank / "net-1_3.ckpt"
    later.write_bytes(b"c")  # after the old inodes' IN_IGNORED: still watched
    wait_for(lambda: rec.seen(later), 10, what="a later file in the re-created directory")


def test_the_root_deleted_and_recreated_is_watched_again(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    rec = _Recorder()
    t = InotifyTree(str(root), rec.on_paths, rec.on_lost, wanted=wanted_name)
    t.open()
    try:
        t.start()
        root.rmdir()
        wait_for(lambda: rec.lost, 10, what="the root's loss reported")
        root.mkdir()
        wait_for(lambda: "the checkpoint root is back" in rec.lost, 10, what="the root watched again")
        shard = root / "run" / "rank_0" / "net-1_1.ckpt"
        shard.parent.mkdir(parents=True)
        shard.write_bytes(b"x")
        wait_for(lambda: rec.seen(shard), 10, what="a file below the re-created root")
    finally:
        t.close()


def test_queue_overflow_asks_for_a_rescan_and_watches_what_it_missed(tmp_path):
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    flood = tmp_path / "flood"
    flood.mkdir()  # watched from open() on
    rec = _Recorder()
    t = InotifyTree(str(tmp_path), rec.on_paths, rec.on_lost, wanted=wanted_name)
    t.open()
    try:
        # nobody reads yet: the kernel queues events up to its limit and drops the rest
        for n in range(limit // 2 + 64):
            (flood / f"f{n}").touch()  # IN_CREATE + IN_CLOSE_WRITE each
        late_dir = tmp_path / "run" / "rank_0"
        late_dir.mkdir(parents=True)  # its IN_CREATE is dropped: the queue is full
        t.start()
        wait_for(lambda: "inotify queue overflowed" in rec.lost, 30, what="the overflow report")
        late = late_dir / "net-1_1.ckpt"
        late.write_bytes(b"w")
        wait_for(lambda: rec.seen(late), 10, what="an event from a directory created during the overflow")
    finally:
        t.close()


@pytest.mark.parametrize("backend", ["inotify", "watchdog"])
def test_daemon_finds_saves_by_events_alone(ms, tmp_path, backend):
    root = tmp_path / "root"
    root.mkdir()
    url = migrated_sqlite(tmp_path / "catalog.db")
    settings = Settings(root=root, db=url, watch_backend=backend, rescan_interval=3600, settle_seconds=0.2, debounce=0.02)
    d = Daemon(settings)
    d.start()
    try:
        assert d.watcher.ready.wait(30), "the initial rescan"
        write_tp_strategy(root / "job")  # a run that starts after the daemon: new directories
        for rank in range(2):
            save_shard(ms, root, "job", rank, 10)
        wait_for(lambda: step_states(url) == {10: "verified"}, 30, what="step 10 verified from events")
        os.unlink(root / "job" / "rank_1" / "net-1_10.ckpt")  # rotation
        wait_for(lambda: step_states(url) == {10: "deleted"}, 30, what="step 10 deleted from an event")
        assert d.watcher.rescans == 1, "no rescan was needed"
        assert query(url, "SELECT count(*) FROM shards")[0][0] == 2
    finally:
        d.stop()
