"""Flash checkpoints for any ``Model.train`` job (issue 22): ``CkptdCallback`` with
``$CKPTD_SNAPSHOT_EVERY=1`` under ``ckptd launch`` and msrun (2 ranks, data parallel). A rank is
SIGKILLed from outside between two of ModelCheckpoint's file saves; ``restore()`` loads the step
from the nodes' memory, and the job's losses and final files are the uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests import trainer_helpers as th
from tests.daemon_helpers import wait_for
from tests.test_launch_user_job import (EPOCHS, FAST_EXIT, STEPS_PER_EPOCH, Serve, attempt_at, both_committed, env,
                                        launch_cmd, losses)


@pytest.mark.slow
def test_model_train_job_resumes_from_memory_between_file_saves(tmp_path):
    shm = tmp_path / "shm"
    serve = Serve(tmp_path / "ckptd", extra_args=("--memory-root", str(shm), "--persist-every", "100"))
    try:
        wait_for(serve.up, timeout=60, interval=0.2, what="ckptd serve to come up")
        ref_dir = tmp_path / "ref"
        ref = subprocess.run(launch_cmd(ref_dir, "--fresh", "--max-restarts", "0", *FAST_EXIT), cwd=th.REPO,
                             env=env(), capture_output=True, text=True, timeout=300, check=False)
        assert ref.returncode == 0, ref.stderr[-3000:]

        run_dir = serve.root / "flashjob"
        e = dict(env(), CKPTD_SNAPSHOT_EVERY="1", CKPTD_MEMORY_ROOT=str(shm))
        launcher = subprocess.Popen(
            launch_cmd(run_dir, "--ckptd-url", serve.url, "--backoff", "0.1", "--max-restarts", "2", *FAST_EXIT,
                       job_args=("--step-sleep", "0.1")),
            cwd=th.REPO, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            # two steps after the step-4 file save: memory holds 6 (and 5), the files only 4
            hb = wait_for(lambda: attempt_at(run_dir, 1, 0, 7) if 4 in both_committed(run_dir) else None,
                          timeout=240, what="attempt 0 two steps past its first file save")
            os.kill(hb["pid"], signal.SIGKILL)
            _, err = launcher.communicate(timeout=300)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
    finally:
        serve.stop()
    log = "\n".join(l for l in err.splitlines() if l.startswith("launch:"))
    assert launcher.returncode == 0, log + err[-3000:]
    answer = json.loads((run_dir / "launcher" / "resume_1.json").read_text())
    assert answer["tier"] == "memory" and hb["step"] - 2 <= answer["step"] <= hb["step"], (hb, answer)
    assert answer["step"] > 4  # not the file save: what the memory tier is for
    got, want = losses(run_dir), losses(ref_dir)
    assert sorted(got) == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1)) == sorted(want)
    for step, hexes in got.items():
        assert hexes == want[step], f"step {step}: {hexes} != {want[step]}"
    for r in range(2):
        final = sorted(n for n in os.listdir(run_dir / f"rank_{r}") if n.endswith("-3_6.ckpt"))
        assert th.read(str(run_dir / f"rank_{r}" / final[-1])) == th.read(str(ref_dir / f"rank_{r}" / "net-3_6.ckpt"))
