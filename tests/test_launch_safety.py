"""What the launcher refuses and keeps (issue 25). Never a silent fresh start (item 1): the launcher refuses to train a run from step 0
over committed saves its oracle cannot see, with one line saying what to fix; only
``--allow-fresh-start`` trains from zero anyway.

The issue's sequence: ``ckptd serve --root`` not containing the job's ``--run-dir``, a 2-rank
``Model.train`` job whose rank 1 is SIGKILLed at step 13 with steps 4, 8 and 12 whole on disk. ckptd
then honestly answers "run not in the catalog", and the launcher used to train again from step 1
and exit 0. Now the mismatch is refused before the job starts (ckptd's node marker is not in the
run dir's parent); an oracle that does not know the run after a failure (here a ``--resume-cmd``
printing ckptd's ``not_found`` answer) stops the launcher with the saves untouched; no oracle at
all, or ``--fresh`` over saves, is refused at start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import trainer_helpers as th
from tests.daemon_helpers import wait_for
from tests.test_launch_user_job import FAKE_JOB, FAST_EXIT, Serve, attempt_at, both_committed, env, launch_cmd

NOT_FOUND = json.dumps({"detail": {"code": "not_found", "message": "run userjob not found"}})


def launcher_lines(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if line.startswith("launch:"))


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.glob("rank_*/*.ckpt"))}


@pytest.fixture(scope="module")
def killed_at_13(tmp_path_factory) -> tuple[Path, str, int]:
    """The issue's job, under an oracle that does not know the run: rank 1 SIGKILLed at step 13
    with steps 4, 8 and 12 committed by both ranks. (run dir, launcher log, exit code)."""
    run_dir = tmp_path_factory.mktemp("fresh") / "userjob"
    oracle = f"echo '{NOT_FOUND}'; exit 1"
    launcher = subprocess.Popen(launch_cmd(run_dir, "--resume-cmd", oracle, "--backoff", "0.1", "--max-restarts", "3",
                                           *FAST_EXIT, job_args=("--step-sleep", "0.1")),
                                cwd=th.REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        hb = wait_for(lambda: attempt_at(run_dir, 1, 0, 13) if {4, 8, 12} <= both_committed(run_dir) else None,
                      timeout=240, what="rank 1 at step 13 with steps 4, 8, 12 committed")
        os.kill(hb["pid"], signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    return run_dir, launcher_lines(err), launcher.returncode


def test_the_issues_sequence_is_refused_before_the_job_starts(tmp_path):
    serve = Serve(tmp_path / "ckptd")  # its root is tmp/ckptd/root; the run dir is elsewhere
    try:
        wait_for(serve.up, timeout=60, interval=0.2, what="ckptd serve to come up")
        run_dir = tmp_path / "elsewhere" / "userjob"
        proc = subprocess.run(launch_cmd(run_dir, "--ckptd-url", serve.url, "--max-restarts", "3", *FAST_EXIT),
                              cwd=th.REPO, env=env(), capture_output=True, text=True, timeout=120, check=False)
        # the run name is the directory's: a --run-name ckptd would never find is refused too
        renamed = subprocess.run(launch_cmd(serve.root / "userjob", "--ckptd-url", serve.url, "--run-name", "other"),
                                 cwd=th.REPO, env=env(), capture_output=True, text=True, timeout=120, check=False)
    finally:
        serve.stop()
    log = launcher_lines(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert log.count("\n") == 0 and "event=refused" in log, log  # one line, before anything started
    assert f"does not watch {run_dir.parent}" in log and f"ckptd serve --root {run_dir.parent}" in log, log
    assert "--allow-fresh-start" in log and not (run_dir / "launcher").exists()
    assert renamed.returncode == 2 and "--run-name 'other' is not the run dir's name 'userjob'" in renamed.stderr


def test_an_oracle_that_does_not_know_the_run_stops_the_launcher_with_the_saves_kept(killed_at_13):
    run_dir, log, rc = killed_at_13
    assert rc == 2, log
    assert "attempt=0 event=rank_failed rank=1" in log, log
    refused = [line for line in log.splitlines() if "event=fresh_start_refused" in line]
    assert len(refused) == 1 and "attempt=1" in refused[0], log
    assert "run not in the catalog yet, but" in refused[0] and "rank_0/net-2_6.ckpt" in refused[0], refused
    assert "--allow-fresh-start" in refused[0]
    assert "attempt=0 event=fresh_start step=0" in log and "attempt=1 event=fresh_start " not in log
    assert "attempt=1 event=started" not in log  # nothing trained over the saves
    assert {4, 8, 12} <= both_committed(run_dir)


def test_fresh_over_saves_and_no_oracle_are_refused_at_start_unless_allowed(killed_at_13, tmp_path):
    run_dir, _, _ = killed_at_13
    before = snapshot(run_dir)
    msrun_free = [sys.executable, "-c", "pass"]
    fresh = subprocess.run([sys.executable, "-m", "ckptd", "launch", "--run-dir", str(run_dir), "--world", "2",
                            "--resume-cmd", "exit 1", "--fresh", "--", *msrun_free],
                           cwd=th.REPO, env=env(), capture_output=True, text=True, timeout=60, check=False)
    assert fresh.returncode == 2 and "--fresh, but" in fresh.stderr and "net-2_6.ckpt" in fresh.stderr, fresh.stderr
    no_oracle = subprocess.run([sys.executable, "-m", "ckptd", "launch", "--run-dir", str(tmp_path / "new"),
                                "--world", "2", "--", *msrun_free],
                               cwd=th.REPO, env={k: v for k, v in env().items() if k != "CKPTD_URL"},
                               capture_output=True, text=True, timeout=60, check=False)
    assert no_oracle.returncode == 2 and "no resume oracle" in no_oracle.stderr, no_oracle.stderr
    assert "--ckptd-url" in no_oracle.stderr and "--allow-fresh-start" in no_oracle.stderr
    assert snapshot(run_dir) == before

    # --allow-fresh-start: the operator's explicit choice, and the job starts from step 0
    out = tmp_path / "fake"
    out.mkdir()
    job = tmp_path / "job.py"
    job.write_text(FAKE_JOB)
    allowed = subprocess.run([sys.executable, "-m", "ckptd", "launch", "--run-dir", str(run_dir), "--world", "2",
                              "--resume-cmd", f"echo '{NOT_FOUND}'; exit 1", "--allow-fresh-start", "--exit-grace",
                              "0", "--", sys.executable, str(job)],
                             cwd=th.REPO, env=dict(env(), OUT=str(out)), capture_output=True, text=True, timeout=60,
                             check=False)
    assert allowed.returncode == 0, allowed.stderr
    assert "attempt=0 event=fresh_start step=0" in allowed.stderr
    assert snapshot(run_dir) == before  # a fresh start deletes nothing either


@pytest.mark.parametrize("command, want", [
    (["msrun", "--worker_num=2", "--log_dir=/l", "--join=True", "t.py", "--log_dir=/mine"],
     ["msrun", "--worker_num=2", "--log_dir=/l/attempt_3", "--join=True", "t.py", "--log_dir=/mine"]),
    (["/x/msrun", "--log_dir", "/l", "t.py"], ["/x/msrun", "--log_dir", "/l/attempt_3", "t.py"]),
    (["msrun", "t.py", "--log_dir", "/mine"], ["msrun", "t.py", "--log_dir", "/mine"]),
    (["python", "t.py", "--log_dir=/mine"], ["python", "t.py", "--log_dir=/mine"]),
])
def test_each_attempt_gets_its_own_msrun_log_dir(command, want):
    from ckptd.launcher.command import per_attempt_log_dir

    got, logs = per_attempt_log_dir(command, 3)
    assert got == want and logs == ("/l/attempt_3" if got != command else None)


def test_sink_mode_is_refused_at_train_begin(ms, monkeypatch, tmp_path):
    """Ascend's default, untestable here (MindSpore on CPU trains non-sink whatever was asked): the
    callback refuses it with what to change instead of resuming wrongly. MindSpore's own RunContext."""
    from mindspore.train.callback import CheckpointConfig, ModelCheckpoint, RunContext
    from mindspore.train.callback._callback import InternalCallbackParam

    from ckptd.integrations.mindspore_callback import CkptdCallback

    for var in ("CKPTD_HEARTBEAT_DIR", "CKPTD_RUN_NAME"):
        monkeypatch.delenv(var, raising=False)
    ckptd_cb = CkptdCallback()
    cb = InternalCallbackParam()
    config = CheckpointConfig(integrated_save=False, append_info=["step_num"])
    cb.list_callback = [ModelCheckpoint(directory=str(tmp_path / "rank_0"), config=config), ckptd_cb]
    cb.cur_step_num = 0
    cb.dataset_sink_mode = True
    with pytest.raises(RuntimeError, match="dataset_sink_mode=True is not supported.*dataset_sink_mode=False"):
        ckptd_cb.on_train_begin(RunContext(cb))
    cb.dataset_sink_mode = False
    ckptd_cb.on_train_begin(RunContext(cb))


# --- the rest of the checklist checked at train begin, in a real Model.train ------------------------


def train_tiny(ms, run_dir: Path, *, ckpt: str = "after", directory: str = "rank_0", integrated_save: bool = False,
               append_info: list | None = None, save_net_only: bool = False, shuffle: bool = False, epochs: int = 1,
               restore: bool = False, pass_initial_epoch: bool = True) -> Path:
    """``epochs`` epochs of 2 steps of a tiny ``Model.train`` with ``ModelCheckpoint`` (``ckpt``:
    "after" / "before" ``CkptdCallback`` in callbacks, or "none") writing into ``run_dir/directory``,
    as rank 0 of the launcher's run ``run_dir`` (its environment variables); ``restore``: calls
    ``CkptdCallback.restore`` first (and passes its ``initial_epoch`` on, unless told not to).
    Returns the checkpoint directory."""
    import numpy as np
    from mindspore import dataset as mds
    from mindspore import nn
    from mindspore.train import CheckpointConfig, Model, ModelCheckpoint

    from ckptd.integrations.mindspore_callback import CkptdCallback

    rng = np.random.default_rng(0)
    data = mds.NumpySlicesDataset({"x": rng.standard_normal((4, 3)).astype(np.float32),
                                   "y": rng.standard_normal((4, 1)).astype(np.float32)}, shuffle=shuffle).batch(2)
    net = nn.Dense(3, 1)
    model = Model(net, nn.MSELoss(), nn.Momentum(net.trainable_params(), 0.01, 0.9))
    config = CheckpointConfig(save_checkpoint_steps=1, integrated_save=integrated_save,
                              append_info=["epoch_num", "step_num"] if append_info is None else append_info,
                              saved_network=net if save_net_only else None)
    rank_dir = run_dir / directory
    ckpt_cb = ModelCheckpoint(prefix="net", directory=str(rank_dir), config=config)
    ckptd_cb = CkptdCallback()
    initial_epoch = ckptd_cb.restore(data, net, model.train_network.optimizer) if restore else 0
    callbacks = {"after": [ckpt_cb, ckptd_cb], "before": [ckptd_cb, ckpt_cb], "none": [ckptd_cb]}[ckpt]
    model.train(epochs, data, callbacks=callbacks, dataset_sink_mode=False,
                initial_epoch=initial_epoch if pass_initial_epoch else 0)
    return rank_dir


@pytest.fixture
def as_launched(tmp_path, monkeypatch) -> Path:
    """The environment ``ckptd launch --run-dir <tmp>/myrun`` gives rank 0 (no oracle, no resume)."""
    run_dir = tmp_path / "myrun"
    monkeypatch.setenv("CKPTD_HEARTBEAT_DIR", str(run_dir / "heartbeat"))
    monkeypatch.setenv("CKPTD_RUN_NAME", "myrun")
    monkeypatch.setenv("RANK_ID", "0")
    for var in ("CKPTD_URL", "CKPTD_RESUME_FILE", "CKPTD_ATTEMPT"):
        monkeypatch.delenv(var, raising=False)
    return run_dir


@pytest.mark.parametrize("how, why", [
    (dict(ckpt="none"), r"no ModelCheckpoint among Model.train's callbacks: nothing would be saved .*; add "
                        r"ModelCheckpoint\(directory=os.path.join\(run_dir, f\"rank_\{rank\}\"\), ...\) "
                        r"before CkptdCallback"),
    (dict(ckpt="before"), r"listed before ModelCheckpoint in callbacks: .*; list it after: callbacks=\[ckpt, ckptd_cb"),
    (dict(directory="rank_1"), r"ModelCheckpoint writes into .*/myrun/rank_1, not .*/myrun/rank_0: ckptd would "
                               r"never find rank 0's saves .*; pass directory=os.path.join\(run_dir, "
                               r"f\"rank_\{rank\}\"\)"),
    (dict(directory="../elsewhere/rank_0"), r"ModelCheckpoint writes into .*/elsewhere/rank_0, not .*/myrun/rank_0"),
    (dict(integrated_save=True), r"ModelCheckpoint's CheckpointConfig has integrated_save=True: ranks would "
                                 r"save merged tensors, not their own shards; pass integrated_save=False to "
                                 r"CheckpointConfig"),
    (dict(append_info=[], save_net_only=True), r"ModelCheckpoint's files would hold no step .*; pass "
                                               r"append_info=\[\"epoch_num\", \"step_num\"\] to CheckpointConfig"),
], ids=["no-ModelCheckpoint", "ckptd-before-ModelCheckpoint", "another-rank's-dir", "outside-the-run-dir",
        "integrated_save", "no-step-in-the-files"])
def test_a_misconfigured_job_is_refused_at_train_begin(ms, as_launched, how, why):
    """Each item of the README's checklist the callback can see: refused in one line saying what to
    change, out of Model.train before its first step (nothing saved)."""
    with pytest.raises(RuntimeError, match=f"^CkptdCallback: {why}") as err:
        train_tiny(ms, as_launched, **how)
    assert "\n" not in str(err.value)
    assert not list(as_launched.parent.rglob("*.ckpt")) and not (as_launched / "heartbeat" / "rank_0.exit").exists()


def test_a_job_as_the_readme_says_trains_and_a_reshuffling_dataset_only_warns(ms, as_launched, caplog):
    """What the checklist asks passes (also the optimizer's global_step in place of append_info's
    step_num); a dataset that reshuffles every epoch resumes, only not bit-exactly: a warning."""
    rank_dir = train_tiny(ms, as_launched)
    assert (rank_dir / "net-1_2.ckpt.done").exists() and (as_launched / "heartbeat" / "rank_0.exit").exists()
    assert "reshuffles" not in caplog.text
    rank_dir = train_tiny(ms, as_launched, append_info=[], shuffle=True)  # global_step holds the step
    assert (rank_dir / "net_1-1_2.ckpt.done").exists()
    assert ("CkptdCallback: the training dataset reshuffles every epoch (RandomSampler of NumpySlicesDataset)"
            in caplog.text)


def test_a_resume_without_restore_or_its_initial_epoch_is_refused(ms, as_launched, monkeypatch):
    """Under a resume (``$CKPTD_RESUME_FILE``) a job that forgot ``restore()`` would train from step
    0, one that forgot to pass its ``initial_epoch`` would replay epoch 1 under step 3's weights:
    refused before any step trains. Both done: it goes on from step 2 (epoch 2)."""
    rank_dir = train_tiny(ms, as_launched)  # saves steps 1 and 2 (epoch 1: 2 steps)
    answer = as_launched / "resume.json"
    answer.write_text(json.dumps({"global_step": 2, "shards": [{"rank": 0, "path": str(rank_dir / "net-1_2.ckpt")}]}))
    monkeypatch.setenv("CKPTD_RESUME_FILE", str(answer))
    monkeypatch.setenv("CKPTD_RESUME_BY", "restore")  # no --resume-args: only restore() would resume it
    with pytest.raises(RuntimeError, match=r"^CkptdCallback: the launcher resumes this run \(\$CKPTD_RESUME_FILE\) "
                                           r"but restore\(\) was not called: .*; call initial_epoch = "
                                           r"ckptd_cb.restore\(dataset, net, optimizer\) before Model.train"):
        train_tiny(ms, as_launched, epochs=2)
    with pytest.raises(RuntimeError, match=r"^CkptdCallback: Model.train starts at epoch 1, but restore\(\) "
                                           r"resumed in epoch 2 \(step 2\); pass initial_epoch=initial_epoch"):
        train_tiny(ms, as_launched, epochs=2, restore=True, pass_initial_epoch=False)
    assert sorted(p.name for p in rank_dir.glob("*.ckpt")) == ["net-1_1.ckpt", "net-1_2.ckpt"]  # nothing new
    train_tiny(ms, as_launched, epochs=2, restore=True)  # steps 3 and 4, epoch 2's
    assert sorted(p.name for p in rank_dir.glob("*.ckpt")) == ["net-1_1.ckpt", "net-1_2.ckpt", "net_1-2_1.ckpt",
                                                                "net_1-2_2.ckpt"]
    # MindFormers' way (--resume-args / --resume-preset mindformers): the job's own arguments load the
    # checkpoint, restore() is not the job's to call, and nothing is refused
    monkeypatch.setenv("CKPTD_RESUME_BY", "args")
    train_tiny(ms, as_launched, epochs=1)
    assert len(list(rank_dir.glob("*.ckpt"))) == 6
