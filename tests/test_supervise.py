"""The launcher's judgement of a running job from its ranks' heartbeat files (real processes, no MindSpore)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from ckptd.launcher.supervise import Job, Watch, least_advanced

#: two "ranks" in one real process: rank 0 reaches the collective of step 5 and blocks there (its
#: last beat is "sync"); rank 1 beats "train" of step 5 a moment *later* and then hangs for good.
#: Rank 0 goes silent first, but it is rank 1 that hung.
BLOCKED_BEHIND_A_HUNG_PEER = """
import sys, time
from ckptd.launcher.heartbeat import Heartbeat
hb_dir = sys.argv[1]
Heartbeat(hb_dir, 1, 0).beat(0, "starting")
Heartbeat(hb_dir, 0, 0).beat(5, "sync")
time.sleep(0.6)
Heartbeat(hb_dir, 1, 0).beat(5, "train")
time.sleep(120)
"""


def _judge(tmp_path, script: str, world: int, heartbeat_timeout: float) -> tuple[str, object]:
    """Run ``script`` (it writes the ranks' heartbeats into argv[1]) as a job and poll the
    launcher's judgement of it as its supervision loop does, until it is not "running"."""
    hb_dir, log_dir = str(tmp_path / "hb"), str(tmp_path / "log")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    job = Job([sys.executable, "-c", script, hb_dir], env, world, hb_dir, log_dir,
              Watch(heartbeat_timeout=heartbeat_timeout, startup_timeout=30.0))
    try:
        deadline = time.time() + 30
        state, failure = job.check()
        while state == "running" and time.time() < deadline:
            time.sleep(0.05)
            state, failure = job.check()
        return state, failure
    finally:
        job.stop()


@pytest.mark.parametrize(("beats", "culprit"), [
    ({0: (5, "sync", 1.0), 1: (5, "train", 2.0)}, 1),     # earlier phase of the same step
    ({0: (6, "train", 1.0), 1: (5, "save", 9.0)}, 1),      # lower step, whatever the phase
    ({0: (5, "sync", 3.0), 1: (5, "sync", 2.0)}, 1),      # same place: the one silent longest
    ({0: (5, "sync", 2.0), 1: (5, "sync", 2.0)}, 0),      # a full tie: the lower rank, deterministically
    ({2: (0, "starting", 5.0), 3: (4, "compute", 1.0)}, 2),
])
def test_the_least_advanced_rank_is_the_culprit(beats, culprit):
    docs = {r: {"step": s, "phase": p, "time": t} for r, (s, p, t) in beats.items()}
    assert least_advanced(docs) == culprit


def test_a_rank_in_its_first_step_is_judged_by_the_start_up_allowance(tmp_path):
    """ckptd's trainer marks an attempt's first step (it compiles) ``startup``: silent longer than
    the heartbeat timeout there is not hung; the same silence in a later step is."""
    script = """
import sys, time
from ckptd.launcher.heartbeat import Heartbeat
Heartbeat(sys.argv[1], 0, 0).beat(4, "compute", startup=True)
time.sleep(2.5)
Heartbeat(sys.argv[1], 0, 0).beat(5, "compute")
time.sleep(120)
"""
    state, failure = _judge(tmp_path, script, 1, heartbeat_timeout=1.0)
    # silent 2.5 s in its first step (timeout 1 s) and not failed there: failed in step 5
    assert state == "failed" and failure is not None and failure.step == 5, (state, failure)


def test_a_rank_blocked_behind_a_hung_peer_is_not_blamed_for_it(tmp_path):
    state, failure = _judge(tmp_path, BLOCKED_BEHIND_A_HUNG_PEER, 2, heartbeat_timeout=3.0)
    assert state == "failed" and failure is not None, (state, failure)
    assert failure.rank == 1 and failure.step == 5, failure
    assert "heartbeat stale" in failure.reason and "phase train of step 5" in failure.reason, failure.reason


def test_a_rank_that_still_beats_is_not_blamed_for_a_silent_one(tmp_path):
    """Ranks not coupled every step (an evaluation rank, say): rank 1 is at an earlier step but
    beats on; rank 0 went silent. Rank 0 is the one hung."""
    script = """
import sys, time
from ckptd.launcher.heartbeat import Heartbeat
Heartbeat(sys.argv[1], 0, 0).beat(5, "sync")
while True:
    Heartbeat(sys.argv[1], 1, 0).beat(3, "train")
    time.sleep(0.1)
"""
    state, failure = _judge(tmp_path, script, 2, heartbeat_timeout=2.0)
    assert state == "failed" and failure is not None and (failure.rank, failure.step) == (0, 5), (state, failure)


def test_free_port_is_drawn_below_the_ephemeral_range_and_is_bindable():
    """msrun's scheduler binds the port seconds after it is chosen: a port of the kernel's ephemeral
    range could meanwhile be handed to another bind(0) or an outgoing connection (a CI run had
    msrun's workers talking to another test's HTTP server)."""
    import socket

    from ckptd.launcher.supervise import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        first_ephemeral = int(fh.read().split()[0])
    ports = {free_port() for _ in range(200)}
    assert all(1024 <= p < first_ephemeral for p in ports)
    assert len(ports) > 100  # drawn at random, not the same few
    with socket.socket() as s:
        s.bind(("", ports.pop()))
