"""The memory tier's slots (docs/FORMATS.md 8): a snapshot is answered only once committed and
whole; a torn, damaged or foreign slot never is; the job's space check names the bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ckptd.integrations.flash import FlashWriter, MemoryTierUnavailable, load_into
from ckptd.storage import memslot


def _state(seed: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [("w", rng.standard_normal((64, 33)).astype(np.float32)), ("b", rng.standard_normal(7).astype(np.float64)),
            ("adam_m.w", rng.standard_normal((64, 33)).astype(np.float32)), ("n", np.arange(5, dtype=np.int32))]


@pytest.fixture
def writer(tmp_path):
    w = FlashWriter(str(tmp_path / "root" / "run1"), 3, 4, root=str(tmp_path / "shm"))
    yield w
    w.release()


def _snapshot(w: FlashWriter, step: int) -> list[tuple[str, np.ndarray]]:
    state = _state(step)
    w.snapshot(step, 1, f"rank_3/net-1_{step}.ckpt", state, [("step_num", step), ("epoch_num", 1)])
    w.wait()
    return state


def test_a_committed_snapshot_reads_back_bit_exactly_from_the_newest_slot(writer):
    _snapshot(writer, 10)
    state = _snapshot(writer, 11)
    snap = memslot.newest(writer.paths, uid=os.geteuid())
    assert snap is not None and snap.table.global_step == 11 and snap.verify()
    assert snap.table.file == "rank_3/net-1_11.ckpt" and snap.table.rank == 3 and snap.table.world_size == 4
    assert [(e.name, e.value) for e in snap.table.entries if not e.is_tensor] == [("step_num", 11), ("epoch_num", 1)]
    snap.close()
    assert {os.stat(p).st_mode & 0o777 for p in writer.paths} == {0o600}
    assert os.stat(writer.dir).st_mode & 0o777 == 0o700
    # hashed while copied, and (the daemon's verified digest named) copied only: the same bytes
    for verified in (None, snap.digest):
        targets = {n: np.zeros_like(a) for n, a in state}
        table = load_into(snap.path, targets, verified=verified)
        assert table.global_step == 11
        for name, a in state:
            assert targets[name].tobytes() == a.tobytes()


def test_double_buffering_keeps_the_other_slot_whole_while_one_is_written(writer):
    _snapshot(writer, 1)
    _snapshot(writer, 2)
    # a copy in progress (or a rank killed in the middle of it): its slot's commit word is 0
    older = [p for p in writer.paths if memslot.open_snapshot(p).table.global_step == 1][0]
    with open(older, "r+b") as fh:
        fh.seek(memslot.SEQ_OFFSET)
        fh.write(b"\0" * 8)
        fh.seek(memslot.PAGE * 3)
        fh.write(b"\x55" * 100)
    assert memslot.open_snapshot(older) is None  # never answered
    snap = memslot.newest(writer.paths)
    assert snap is not None and snap.table.global_step == 2
    snap.close()
    # and the next snapshot goes into the torn slot, never over the whole one
    _snapshot(writer, 3)
    assert sorted(memslot.open_snapshot(p).table.global_step for p in writer.paths) == [2, 3]


def test_a_damaged_slot_is_refused_with_the_reason(writer):
    _snapshot(writer, 5)
    path = memslot.newest(writer.paths).path
    with open(path, "r+b") as fh:
        off = memslot.read_header(fh.read(memslot.PAGE), path).payload_off
        fh.seek(off + 17)
        b = fh.read(1)
        fh.seek(off + 17)
        fh.write(bytes([b[0] ^ 0x40]))
    snap = memslot.open_snapshot(path)
    with pytest.raises(memslot.SlotError, match="digest mismatch.*step 5 is damaged"):
        snap.verify()
    snap.close()
    targets = {n: np.zeros_like(a) for n, a in _state(5)}
    # the digest is checked in the copy's pass (one read of the slot): the load raises, and the
    # caller (restore()) raises it out of the job, which never trains on what was copied
    with pytest.raises(memslot.SlotError, match="digest mismatch"):
        load_into(path, targets)
    # a digest the daemon verified for other bytes (not the slot's) vouches for nothing: hashed, refused
    with pytest.raises(memslot.SlotError, match="digest mismatch"):
        load_into(path, targets, verified="0" * 32)


def test_a_slot_others_can_read_or_of_another_user_is_refused(writer, tmp_path):
    _snapshot(writer, 5)
    path = memslot.newest(writer.paths).path
    os.chmod(path, 0o644)
    with pytest.raises(memslot.SlotError, match="mode 0644"):
        memslot.open_snapshot(path)
    os.chmod(path, 0o600)
    with pytest.raises(memslot.SlotError, match="owned by uid"):
        memslot.open_snapshot(path, uid=os.geteuid() + 1)
    other = tmp_path / "not-a-slot"
    other.write_bytes(b"x" * 5000)
    os.chmod(other, 0o600)
    with pytest.raises(memslot.SlotError, match="not a ckptd memory slot"):
        memslot.open_snapshot(str(other))


def test_a_model_mismatch_loads_nothing(writer):
    _snapshot(writer, 5)
    path = memslot.newest(writer.paths).path
    targets = {"w": np.zeros((64, 32), np.float32)}
    with pytest.raises(memslot.SlotError, match="does not match this model"):
        load_into(path, targets)
    assert not targets["w"].any()


def test_restart_numbering_continues_so_an_older_snapshot_never_looks_newer(tmp_path):
    kw = dict(root=str(tmp_path / "shm"))
    w = FlashWriter(str(tmp_path / "r" / "run1"), 0, 1, **kw)
    _snapshot(w, 7)
    _snapshot(w, 8)
    w.close_maps()
    again = FlashWriter(str(tmp_path / "r" / "run1"), 0, 1, **kw)  # the restarted job, resumed at 8
    _snapshot(again, 9)
    assert memslot.newest(again.paths).table.global_step == 9
    assert sorted(memslot.open_snapshot(p).table.global_step for p in again.paths) == [8, 9]
    again.release()
    assert not os.path.exists(again.dir)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for a private tmpfs")
def test_too_little_shared_memory_is_a_clear_error_naming_the_bytes(tmp_path):
    """A real 1 MiB tmpfs in a private mount namespace: two slots of ~2.2 MiB do not fit."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    code = textwrap.dedent(f"""
        import numpy as np
        from ckptd.integrations.flash import FlashWriter, MemoryTierUnavailable
        w = FlashWriter({str(tmp_path / 'run1')!r}, 0, 1, root={str(mnt)!r} + "/ckptd")
        try:
            w.snapshot(1, 1, "rank_0/net-1_1.ckpt", [("w", np.ones(1 << 18, np.float64))], [])
        except MemoryTierUnavailable as exc:
            print("REFUSED", exc)
    """)
    script = tmp_path / "probe.py"
    script.write_text(code)
    out = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=1m none {mnt} && "
                          f"{sys.executable} {script}"], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    msg = out.stdout.split("REFUSED", 1)[1]
    assert "needs 4210688 bytes" in msg and "(2105344 each)" in msg and "1048576 bytes are free" in msg and "file checkpoints go on" in msg


def test_a_state_that_grows_never_destroys_the_newest_snapshot(writer):
    _snapshot(writer, 1)
    _snapshot(writer, 2)
    bigger = _state(3) + [("extra", np.ones(300_000, np.float32))]  # the slot must grow
    writer.snapshot(3, 1, "rank_3/net-1_3.ckpt", bigger, [("step_num", 3)])
    writer.wait()
    assert sorted(memslot.open_snapshot(p).table.global_step for p in writer.paths) == [2, 3]
    snap = memslot.newest(writer.paths)
    assert snap.table.global_step == 3 and snap.verify()
    snap.close()


def test_a_scalar_keeps_its_zero_dimensions(writer):
    writer.snapshot(1, 1, "rank_3/net-1_1.ckpt", [("momentum", np.array(0.9, np.float32))], [])
    writer.wait()
    snap = memslot.newest(writer.paths)
    assert [e.shape for e in snap.table.entries] == [()]
    snap.close()


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_the_job_creates_its_directories_0700_and_its_slots_0600_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        w = FlashWriter(str(tmp_path / "root" / "run1"), 0, 1, root=str(tmp_path / "shm"))
        try:
            for step in (1, 2):  # both slots, the second a reopen of neither
                w.snapshot(step, 1, f"rank_0/net-1_{step}.ckpt", _state(step), [])
                w.wait()
            assert {os.stat(p).st_mode & 0o7777 for p in w.paths} == {0o600}
            assert {os.stat(d).st_mode & 0o7777 for d in (w.dir, os.path.dirname(w.dir))} == {0o700}
            snap = memslot.newest(w.paths, uid=os.geteuid())
            assert snap is not None and snap.table.global_step == 2
            snap.close()
        finally:
            w.release()
    finally:
        os.umask(old)
