"""Hostile trees, round 2 (issue 26, findings 2, 3, 5 and the hardlink one): a conversion or the
tracker repair racing a directory swapped for a symlink never writes outside the root; a planted
``strategy.ckpt`` link is never read into the catalog nor handed to a launcher; a lost converted
copy is replaced by converting again; a hard link into the root is refused and no reason quotes a
file's bytes. Real MindSpore files, real catalogs, real threads racing real conversions."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from sqlalchemy.orm import sessionmaker

from ckptd.split import parse_split
from ckptd import runlayout
from ckptd.storage import ConfinementError, PosixStorage
from ckptd.errors import CkptdError
from tests.daemon_helpers import migrated_sqlite, query, save_shard, save_tp_step, started_daemon, step_states, wait_for


def _everything_in(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _verified_step(ms, root: Path, url: str, run: str = "r", step: int = 2):
    """A verified 2-rank step in the catalog (the daemon stopped: nothing else writes meanwhile)
    and sessions on it."""
    from ckptd.catalog.db import make_engine

    save_tp_step(ms, root, run, step)
    d = started_daemon(root, url)
    try:
        wait_for(lambda: step_states(url).get(step) == "verified", 60, what=f"step {step} verified")
    finally:
        d.stop()
    return sessionmaker(make_engine(url), expire_on_commit=False)


def _target_hash(root: Path, run: str, layout: str) -> str:
    from ckptd.format.strategy import load_strategy
    from ckptd.service.conversions import resolve_target

    src = load_strategy(root / run / "strategy.ckpt")
    return resolve_target(src, None, parse_split(layout), str(root)).content_hash()


class Swapper(threading.Thread):
    """As soon as ``target`` is a real directory, move it aside (inside the root) and put a
    symlink to ``outside`` in its place: what a job writing into the root can do at any moment.
    With ``empty_only`` it swaps only a directory nothing was written into yet (the moment a
    writer that goes by name would create everything on the other side)."""

    def __init__(self, target: Path, outside: Path, empty_only: bool = False) -> None:
        super().__init__(daemon=True)
        self.target, self.outside, self.stop, self.swaps = target, outside, threading.Event(), 0
        self.empty_only = empty_only

    def run(self) -> None:
        aside = self.target.with_name(self.target.name + ".aside")
        while not self.stop.is_set():
            try:
                if self.target.is_dir() and not self.target.is_symlink():
                    if self.empty_only and os.listdir(self.target):
                        return  # too late for this try
                    os.rename(self.target, aside)
                    os.symlink(self.outside, self.target)
                    self.swaps += 1
                    return
            except OSError:
                pass


# --- finding 2: a conversion racing a symlink swap -----------------------------------------------


@pytest.mark.timeout(300)
def test_a_conversion_racing_a_symlink_swap_never_writes_outside_the_root(ms, root, outside, tmp_path):
    from ckptd.service.conversions import convert_step

    url = migrated_sqlite(tmp_path / "catalog.db")
    sessions = _verified_step(ms, root, url)
    # the default output name, as an attacker predicts it
    out = root / "r" / "converted" / f"2-{_target_hash(root, 'r', 'tp=1,dp=1').split(':')[-1][:12]}"
    outcomes: dict[str, int] = {}
    swaps = 0
    copy_rows = ("SELECT s.path, s.inode FROM shards s JOIN checkpoints c ON c.id = s.checkpoint_id "
                 "WHERE c.kind = 'converted' AND s.state = 'verified'")
    for i in range(30):
        # rows an earlier try left (its files removed below since; no daemon runs here to notice)
        before = set(query(url, copy_rows))
        racer = Swapper(out, outside, empty_only=i % 2 == 0)
        racer.start()
        done = False
        try:
            convert_step(sessions, PosixStorage(str(root)), "r", 2, split=parse_split("tp=1,dp=1"))
            done = True
            outcomes["done"] = outcomes.get("done", 0) + 1
        except CkptdError as err:  # refused: fine, as long as nothing escaped (never another exception)
            why = f"{err.code}: {err.message[:40]}"
            outcomes[why] = outcomes.get(why, 0) + 1
        finally:
            racer.stop.set()
            racer.join(10)
        swaps += racer.swaps
        assert _everything_in(outside) == [], f"try {i}: written outside the root"
        if racer.swaps:
            aside = out.with_name(out.name + ".aside")
            rows = [r for r in query(url, copy_rows) if tuple(r) not in before]  # what this try catalogued
            if done:
                # The racer swapped once the copy was checked in place (possibly after convert_step
                # returned: the racer runs until told to stop). Then the catalogued files are the
                # ones moved aside, whole: the very inodes recorded, not anything planted.
                for path, inode in rows:
                    moved = aside / os.path.relpath(path, out)
                    assert PosixStorage(str(root)).is_file(path) or moved.stat().st_ino == inode, path
            else:
                # refused: no catalog row may name a file that is not there, and what it wrote into
                # the moved directory before noticing is removed, not left looking whole
                for path, _ in rows:
                    assert PosixStorage(str(root)).is_file(path), path
                assert not any(p.name.startswith("rank_") for p in aside.iterdir()), _everything_in(aside)
            os.unlink(out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            shutil.rmtree(out, ignore_errors=True)  # a finished copy lost: the next try replaces it (finding 5)
    assert swaps > 0, "the racer never hit a running conversion"
    print(f"swaps during a conversion: {swaps} of 30; outcomes {outcomes}")


@pytest.mark.timeout(120)
def test_the_tracker_repair_racing_a_symlink_swap_never_writes_outside_the_root(root, outside):
    from ckptd.service import tracker

    run = root / "mf"
    ckpt_dir = run / runlayout.MF_CHECKPOINT_DIR
    Path(runlayout.iteration_dir(str(run), 2)).mkdir(parents=True)
    # the same names outside, so every check by name passes once the link is in place
    outside_ckpt = outside / "checkpoint"
    (outside_ckpt / os.path.basename(runlayout.iteration_dir(str(run), 2))).mkdir(parents=True)
    before_outside = None
    hits = 0
    for i in range(200):
        (ckpt_dir / runlayout.MF2_TRACKER).write_text("1")
        (outside_ckpt / runlayout.MF2_TRACKER).write_text("1")
        before_outside = _everything_in(outside)
        racer = Swapper(ckpt_dir, outside_ckpt)
        racer.start()
        try:
            tracker.repair(PosixStorage(str(root)), str(run), 2, verified=True)
        except CkptdError:
            pass  # refused: fine, as long as nothing escaped
        finally:
            racer.stop.set()
            racer.join(10)
        assert _everything_in(outside) == before_outside, f"try {i}: a file created outside the root"
        assert (outside_ckpt / runlayout.MF2_TRACKER).read_text() == "1", f"try {i}: a file outside rewritten"
        if racer.swaps:
            hits += 1
            os.unlink(ckpt_dir)
            os.rename(ckpt_dir.with_name(ckpt_dir.name + ".aside"), ckpt_dir)
    assert hits > 0


# --- finding 3: a planted strategy.ckpt link ------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_planted_strategy_link_is_never_read_nor_served(ms, root, outside, catalog_url):
    from ckptd.service.conversions import convert_step
    from ckptd.service.resume import ResumeOptions, resume

    sessions = _verified_step(ms, root, catalog_url)
    secret = outside / "passwd"
    secret.write_text("root:x:0:0:SECRET-CONTENT:/root:/bin/sh\n")
    out = root / "r" / "converted" / f"2-{_target_hash(root, 'r', 'tp=1,dp=1').split(':')[-1][:12]}"
    out.mkdir(parents=True)
    os.symlink(secret, out / "strategy.ckpt")
    with pytest.raises(ConfinementError, match="symlink"):
        convert_step(sessions, PosixStorage(str(root)), "r", 2, split=parse_split("tp=1,dp=1"))
    assert query(catalog_url, "SELECT count(*) FROM checkpoints WHERE kind = 'converted'") == [(0,)]
    assert not any(b"SECRET" in (c or b"") for (c,) in query(catalog_url, "SELECT content FROM strategy_files"))
    assert sorted(os.listdir(out)) == ["strategy.ckpt"]  # refused before anything was written; the link left alone
    # the link gone, the conversion runs; a link swapped in afterwards is not handed to a launcher
    os.unlink(out / "strategy.ckpt")
    doc = convert_step(sessions, PosixStorage(str(root)), "r", 2, split=parse_split("tp=1,dp=1"))
    with sessions.begin() as s:
        existing = resume(s, "r", ResumeOptions(world_size=1, lease=False))["conversion"]["existing"]
    assert existing["strategy_file"] == str(out / "strategy.ckpt")
    os.replace(out / "strategy.ckpt", outside / "moved.ckpt")
    os.symlink(secret, out / "strategy.ckpt")
    with sessions.begin() as s:
        existing = resume(s, "r", ResumeOptions(world_size=1, lease=False))["conversion"]["existing"]
    assert existing["strategy_file"] is None and existing["strategy_hash"] == doc["target_strategy_hash"]


# --- finding 5: a lost converted copy ------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_lost_converted_copy_is_not_offered_and_converting_again_replaces_it(ms, root, catalog_url):
    from ckptd.service.conversions import convert_step
    from ckptd.service.resume import ResumeOptions, resume

    save_tp_step(ms, root, "r", 2)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {2: "verified"}, 60, what="step 2 verified")
        first = convert_step(d.sessions, PosixStorage(str(root)), "r", 2, split=parse_split("tp=1,dp=1"), node=d.settings.node_name)
        shutil.rmtree(first["out_dir"])  # the copy's files are gone
        d.watcher.poke_rescan()
        wait_for(lambda: query(catalog_url, "SELECT state FROM checkpoints WHERE kind = 'converted'") == [("deleted",)],
                 60, what="the copy following its files")
        with d.sessions.begin() as s:
            assert resume(s, "r", ResumeOptions(world_size=1, lease=False))["conversion"]["existing"] is None
        again = convert_step(d.sessions, PosixStorage(str(root)), "r", 2, split=parse_split("tp=1,dp=1"), node=d.settings.node_name)
        assert again["state"] == "done" and not again["reused"] and again["out_dir"] == first["out_dir"]
        assert again["output_checkpoint_id"] == first["output_checkpoint_id"]  # the lost copy's row, replaced
        # lost again, before any rescan noticed: converting again still replaces it
        shutil.rmtree(first["out_dir"])
        third = convert_step(d.sessions, PosixStorage(str(root)), "r", 2, split=parse_split("tp=1,dp=1"), node=d.settings.node_name)
        assert third["state"] == "done" and not third["reused"]
        with d.sessions.begin() as s:
            existing = resume(s, "r", ResumeOptions(world_size=1, lease=False))["conversion"]["existing"]
        assert [os.path.exists(sh["path"]) for sh in existing["shards"]] == [True]
        assert query(catalog_url, "SELECT state FROM checkpoints WHERE kind = 'converted'") == [("verified",)]
        assert query(catalog_url, "SELECT s.state, count(*) FROM shards s JOIN checkpoints c ON c.id = s.checkpoint_id "
                                  "WHERE c.kind = 'converted' GROUP BY s.state") == [("verified", 1)]
    finally:
        d.stop()


# --- hard links ----------------------------------------------------------------------------------


def test_open_beneath_refuses_hard_links_unless_allowed(root, outside):
    (outside / "secret").write_bytes(b"SECRETS!")
    os.link(outside / "secret", root / "linked.ckpt")
    with pytest.raises(ConfinementError, match="2 hard links"):
        PosixStorage(str(root)).read(str(root / "linked.ckpt"), 100)
    assert PosixStorage(str(root), hardlinks=True).read(str(root / "linked.ckpt"), 100) == b"SECRETS!"


def test_no_error_quotes_the_first_bytes_of_a_file(tmp_path):
    from ckptd.format.checkpoint import open_checkpoint
    from ckptd.format.crypto_blocks import EncMode, scan_headers

    bad = tmp_path / "x.ckpt"
    bad.write_bytes(b"SECRETS!" + b"\0" * 64)
    with pytest.raises(CkptdError) as err:
        open_checkpoint(bad)
    assert "expected" in err.value.message and b"SECRETS!".hex(" ")[:11] not in str(err.value)
    with pytest.raises(CkptdError) as err:
        scan_headers(memoryview(bad.read_bytes()), EncMode.AES_GCM, str(bad))
    assert "53 45 43 52" not in str(err.value)


@pytest.mark.timeout(120)
def test_a_hard_link_into_the_root_is_refused_and_never_quoted(ms, root, outside, tmp_path):
    url = migrated_sqlite(tmp_path / "catalog.db")
    save_shard(ms, root, "h", 1, 2)
    (outside / "secret").write_bytes(b"SECRETS!" + b"x" * 200)
    (root / "h" / "rank_0").mkdir()
    os.link(outside / "secret", root / "h" / "rank_0" / "net-1_2.ckpt")
    d = started_daemon(root, url)
    try:
        def said() -> list[tuple]:
            rows = query(url, "SELECT reason FROM checkpoints")
            return rows if rows and all(r for (r,) in rows) else []
        (reason,), = wait_for(said, 60, what="the step saying why it waits")
    finally:
        d.stop()
    texts = [reason] + [t for row in query(url, "SELECT error FROM shards") for t in row if t]
    assert "hard link" in reason, reason
    assert not any("53 45 43 52" in t or "SECRETS" in t for t in texts), texts
