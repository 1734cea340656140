"""``--layout mindformers``: the trainer writes exactly MindFormers 2.1.0's legacy checkpoint layout.

What MindFormers' ``CheckpointMonitor`` (over MindSpore's ``ModelCheckpoint``) puts in its
output_dir, and what is checked here on real files of the real trainer:

* ``checkpoint/rank_<r>/{P}_rank_<r>[_<k>]-{E}_{S}.ckpt``: ``S`` the step within epoch ``E``,
  ``_<k>`` the k-th restart into the directory (MindSpore's ``_chg_ckpt_file_name_if_same_exist``);
* append entries ``epoch_num`` (= E), ``step_num`` (the global step), ``global_step`` (Int32 ``[1]``),
  ``loss_scale``, ``global_batch_size``;
* ``checkpoint/rank_<r>/meta.json`` = exactly ``{"last_epoch", "last_step", "last_ckpt_file"}``,
  lagging one save behind under async saves (the last async save is never recorded), current
  under sync saves;
* ``strategy/ckpt_strategy_rank_<r>.ckpt`` on every rank (no ``strategy.ckpt``, no ``rank_<r>/``).

A killed multi-rank job restarted by the launcher into the same directory resumes (the stand-in
oracle trainer.scan_resume picks the step) and trains on bit for bit, writing the next
incarnation's ``_1`` files.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ckptd import runlayout
from ckptd.runlayout import MINDFORMERS
from tests import trainer_helpers as th
from trainer.checkpoint import build_strategy, epoch_and_step, restart_incarnation
from trainer.config import ModelConfig, param_specs
from trainer.oracle import committed_saves, committed_steps
from trainer.scan_resume import scan
from trainer.topology import Topology

MF = ("--layout", MINDFORMERS)
STEPS = ["--steps", "8", "--save-every", "3"]  # saves at global steps 3, 6, 8
CFG = ModelConfig(hidden=32, heads=4, ffn=64, layers=2, seq=16)  # th.TINY
META_KEYS = {"last_epoch", "last_step", "last_ckpt_file"}


def mf_shard(run_dir, rank: int, epoch: int, step: int, k: int = 0) -> str:
    return th.shard(run_dir, rank, step, epoch=epoch, layout=MINDFORMERS, incarnation=k)


def meta(run_dir, rank: int) -> dict:
    with open(runlayout.meta_path(str(run_dir), rank)) as fh:
        return json.load(fh)


def rank_files(run_dir, rank: int) -> set[str]:
    return set(os.listdir(runlayout.shard_dir(str(run_dir), rank, MINDFORMERS)))


# --- pure pieces --------------------------------------------------------------------------------


def test_epoch_and_step_in_epoch():
    assert [epoch_and_step(s, 4) for s in (1, 3, 4, 5, 8, 9)] == [(1, 1), (1, 3), (1, 4), (2, 1), (2, 4), (3, 1)]
    assert epoch_and_step(1234, None) == (1, 1234) and epoch_and_step(0, 4) == (0, 0)


def test_restart_suffix_is_mindspores_choice(tmp_path):
    d = tmp_path / "rank_0"
    d.mkdir()

    def k() -> int:
        return restart_incarnation(str(d), "llama_rank_0")

    assert k() == 0
    for ignored in ("llama_rank_0-1_3.tmp", "llama_rank_0-1_3_breakpoint.ckpt", "meta.json", "tmpab12cd",
                    "llama_rank_0-1_3.ckpt.done", "other_rank_0-1_3.ckpt"):
        (d / ignored).write_bytes(b"")
    assert k() == 0  # in-flight, breakpoint, sidecar, meta and other prefixes never count
    (d / "llama_rank_0-1_3.ckpt").write_bytes(b"")
    assert k() == 1
    (d / "llama_rank_0_3-2_1.ckpt").write_bytes(b"")
    assert k() == 4  # highest n + 1, not the number of restarts seen
    (d / "llama_rank_0_1-1_6.safetensors").write_bytes(b"")
    assert k() == 4


# --- one rank (no msrun) ------------------------------------------------------------------------


def test_one_rank_names_entries_meta_lag_and_strategy(tmp_path, ms):
    d = tmp_path / "output"
    th.train(d, *MF, *STEPS, "--micro-batch", "4", "--steps-per-epoch", "4")
    # global steps 3, 6, 8 in epochs of 4 steps: 1_3, 2_2, 2_4
    names = ["llama_rank_0-1_3.ckpt", "llama_rank_0-2_2.ckpt", "llama_rank_0-2_4.ckpt"]
    assert rank_files(d, 0) == {*names, *(n + ".done" for n in names), "meta.json"}
    assert sorted(os.listdir(d)) == ["checkpoint", "heartbeat", "metrics.jsonl", "strategy"]
    assert os.listdir(d / "strategy") == ["ckpt_strategy_rank_0.ckpt"]
    # async saves: meta.json names the save before the last one (the last is never recorded)
    assert meta(d, 0) == {"last_epoch": 2, "last_step": 2, "last_ckpt_file": "llama_rank_0-2_2.ckpt"}
    got = th.load(ms, mf_shard(d, 0, 2, 4))
    assert {k: (got[k].dtype.name, got[k].shape, got[k].tolist()) for k in
            ("epoch_num", "step_num", "global_step", "loss_scale", "global_batch_size")} == {
        "epoch_num": ("int64", (), 2), "step_num": ("int64", (), 8), "global_step": ("int32", (1,), [8]),
        "loss_scale": ("int64", (), 1), "global_batch_size": ("int64", (), 4)}
    answer = scan(str(d), 1)  # the stand-in oracle on this layout: global step from the file
    assert (answer["step"], answer["epoch"], answer["name_step"], answer["prefix"]) == (8, 2, 4, "llama")
    assert answer["shards"] == [{"rank": 0, "path": mf_shard(d, 0, 2, 4)}]
    assert answer["strategy_file"] == str(d / "strategy")


def test_one_rank_sync_save_meta_is_current(tmp_path):
    d = tmp_path / "output"
    th.train(d, *MF, "--steps", "4", "--save-every", "2", "--sync-save")  # default epoch: E=1, S=global step
    assert meta(d, 0) == {"last_epoch": 1, "last_step": 4, "last_ckpt_file": "llama_rank_0-1_4.ckpt"}
    assert set(meta(d, 0)) == META_KEYS
    assert oct(os.stat(runlayout.meta_path(str(d), 0)).st_mode & 0o777) == "0o640"
    assert committed_steps(str(d), 1) == [(1, 4), (1, 2)]


# --- msrun: a killed job restarted into the same directory ----------------------------------------


@pytest.fixture(scope="module")
def ref_tp2(tmp_path_factory):
    """The uninterrupted job (one attempt)."""
    d = tmp_path_factory.mktemp("mf_ref") / "output"
    rc, log = th.launch(d, 2, 1, *STEPS, "--micro-batch", "4", "--steps-per-epoch", "4", layout=MINDFORMERS,
                        launch_args=("--fresh",))
    assert rc == 0, log
    return d


def test_tp2_restart_into_the_same_dir_writes_next_incarnation_and_resumes_exactly(ref_tp2, tmp_path, ms):
    d = tmp_path / "output"
    rc, log = th.launch(d, 2, 1, *STEPS, "--micro-batch", "4", "--steps-per-epoch", "4", layout=MINDFORMERS,
                        faults=("kill:1:5",))
    assert rc == 0, log
    assert "attempt=0 event=rank_failed rank=1 step=5" in log and "attempt=1 event=resume step=3" in log, log
    answer = json.loads((d / "launcher" / "resume_1.json").read_text())
    assert answer["shards"] == [{"rank": r, "path": mf_shard(d, r, 1, 3)} for r in range(2)]

    # the layout: attempt 0's files, then attempt 1's under the next incarnation's prefix
    assert sorted(os.listdir(d / "checkpoint")) == ["rank_0", "rank_1"]
    assert not os.path.exists(d / "rank_0") and not os.path.exists(d / "strategy.ckpt")
    for r in range(2):
        names = [f"llama_rank_{r}-1_3.ckpt", f"llama_rank_{r}_1-2_2.ckpt", f"llama_rank_{r}_1-2_4.ckpt"]
        assert rank_files(d, r) == {*names, *(n + ".done" for n in names), "meta.json"}, r
        # MindFormers' meta.json: the restart overwrote it with its own (lagging) save
        assert meta(d, r) == {"last_epoch": 2, "last_step": 2, "last_ckpt_file": f"llama_rank_{r}_1-2_2.ckpt"}
        assert meta(ref_tp2, r) == {"last_epoch": 2, "last_step": 2, "last_ckpt_file": f"llama_rank_{r}-2_2.ckpt"}
    # per-rank strategy files, same content (no pipeline stages), exactly the trainer's layout
    strategies = [th.read(runlayout.rank_strategy_path(str(d), r)) for r in range(2)]
    assert sorted(os.listdir(d / "strategy")) == ["ckpt_strategy_rank_0.ckpt", "ckpt_strategy_rank_1.ckpt"]
    assert strategies[0] == strategies[1]
    from ckptd.format.strategy import load_strategy

    assert load_strategy(runlayout.rank_strategy_path(str(d), 1)).content_hash() == \
        build_strategy(param_specs(CFG), Topology(2, 1, 0)).content_hash()

    # append entries of the resumed job's last save, as MindFormers writes them
    last = [th.load(ms, mf_shard(d, r, 2, 4, k=1)) for r in range(2)]
    for r, got in enumerate(last):
        assert (int(got["epoch_num"]), int(got["step_num"]), got["global_step"].tolist(), int(got["loss_scale"]),
                int(got["global_batch_size"]), int(got["rank_id"])) == (2, 8, [8], 1, 4, r)

    # bitwise: every loss, and the final shards equal the uninterrupted job's (only the names differ)
    ref, got = th.losses(ref_tp2), th.losses(d)
    assert sorted(got) == list(range(1, 9))
    for step, entries in got.items():
        assert {h for _, h in entries} == {ref[step][0][1]}, f"loss of step {step} differs after resume"
    # step 4 trained again after the resume (attempt 0's line for it is there unless rank 0 was
    # stopped between rank 1's death and writing it)
    assert [a for a, _ in got[4]] in ([0, 1], [1])
    for r in range(2):
        assert th.read(mf_shard(d, r, 2, 4, k=1)) == th.read(mf_shard(ref_tp2, r, 2, 4)), r
        assert th.read(mf_shard(d, r, 2, 2, k=1)) == th.read(mf_shard(ref_tp2, r, 2, 2)), r

    # the launcher's and the stand-in oracle's view of the run: steps by (prefix with _k, epoch, step)
    assert committed_saves(str(d), 2) == [("llama_1", 2, 4), ("llama_1", 2, 2), ("llama", 1, 3)]
    again = scan(str(d), 2)
    assert (again["step"], again["prefix"], again["epoch"], again["name_step"]) == (8, "llama_1", 2, 4)
    assert again["shards"] == [{"rank": r, "path": mf_shard(d, r, 2, 4, k=1)} for r in range(2)]


def test_scan_prefers_the_later_restart_and_never_mixes_incarnations(ref_tp2, tmp_path):
    """Two restarts' saves of one (epoch, step) are two steps; a step is only ever one incarnation's."""
    import shutil

    d = tmp_path / "output"
    shutil.copytree(ref_tp2 / "checkpoint", d / "checkpoint")
    # restart 1 saved step 8 again on rank 0 only (rank 1 died before its save)
    src = mf_shard(d, 0, 2, 4)
    shutil.copy(src, mf_shard(d, 0, 2, 4, k=1))
    shutil.copy(src + ".done", mf_shard(d, 0, 2, 4, k=1) + ".done")
    answer = scan(str(d), 2)
    assert answer["prefix"] == "llama" and answer["shards"] == [{"rank": r, "path": mf_shard(d, r, 2, 4)}
                                                                 for r in range(2)]
    assert answer["skipped"] == [{"step": 4, "reason": "incomplete: ranks [1] not committed"}]
    shutil.copy(mf_shard(d, 1, 2, 4), mf_shard(d, 1, 2, 4, k=1))
    shutil.copy(mf_shard(d, 1, 2, 4) + ".done", mf_shard(d, 1, 2, 4, k=1) + ".done")
    answer = scan(str(d), 2)
    assert answer["prefix"] == "llama_1" and answer["skipped"] == []
    assert committed_steps(str(d), 2) == [(2, 4), (2, 2), (1, 3)]  # one entry per (epoch, step)


@pytest.mark.slow
def test_tp2_dp2_mindformers_layout_resumes_exactly_after_sigkill(tmp_path):
    ref = tmp_path / "ref"
    rc, log = th.launch(ref, 2, 2, *STEPS, "--micro-batch", "2", layout=MINDFORMERS, launch_args=("--fresh",))
    assert rc == 0, log
    d = tmp_path / "output"
    rc, log = th.launch(d, 2, 2, *STEPS, "--micro-batch", "2", layout=MINDFORMERS, faults=("kill:2:8",))
    assert rc == 0, log
    assert "event=rank_failed rank=2 step=8" in log and "event=resume step=6" in log, log
    got, want = th.losses(d), th.losses(ref)
    assert all({h for _, h in e} == {want[s][0][1]} for s, e in got.items()) and sorted(got) == list(range(1, 9))
    for r in range(4):
        assert th.read(mf_shard(d, r, 1, 8, k=1)) == th.read(mf_shard(ref, r, 1, 8)), r
        assert os.path.exists(runlayout.rank_strategy_path(str(d), r))
        assert set(meta(d, r)) == META_KEYS
    np.testing.assert_array_equal(sorted(runlayout.rank_dirs(str(d), MINDFORMERS)), [0, 1, 2, 3])


# --- msrun + the launcher asking a real `ckptd serve` -----------------------------------------------


def test_launcher_resumes_a_mindformers_layout_job_from_ckptd_serve(ref_tp2, tmp_path, ms):
    """The launcher's oracle is ``ckptd serve`` over HTTP (not the stand-in scan): it catalogues the
    trainer's MindFormers files, answers the killed job's resume with every rank's MindFormers shard
    and what MindFormers' own loader takes, and the job trains on bit for bit; the restart's ``_1``
    files are then the newest answer."""
    import subprocess
    import sys

    from tests.api_helpers import serve_process, stop_process
    from tests.daemon_helpers import migrated_sqlite, wait_for

    root = tmp_path / "root"
    root.mkdir()
    url = migrated_sqlite(tmp_path / "catalog.db")
    log = tmp_path / "serve.log"
    proc, client = serve_process(root, url, log)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"ckptd serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                return bool(client.get("/healthz").json().get("first_rescan_done"))
            except Exception:  # noqa: BLE001 -- not listening yet
                return False

        wait_for(up, 60, interval=0.2, what="ckptd serve to come up")
        d = root / "job"
        cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(d), "--layout", MINDFORMERS, "--tp", "2",
               "--dp", "1", "--ckptd-url", str(client.base_url).rstrip("/"), "--backoff", "0.2",
               "--fault", "kill:1:5", "--", *th.TINY, *STEPS, "--micro-batch", "4", "--steps-per-epoch", "4"]
        run = subprocess.run(cmd, cwd=th.REPO, env=th.env(), capture_output=True, text=True, timeout=600, check=False)
        lines = "\n".join(x for x in run.stderr.splitlines() if x.startswith("launch:"))
        assert run.returncode == 0, f"{lines}\n{run.stderr[-3000:]}\nserve log:\n{log.read_text()[-3000:]}"
        assert "attempt=0 event=rank_failed rank=1 step=5" in lines and "attempt=1 event=resume step=3" in lines, lines

        answer = json.loads((d / "launcher" / "resume_1.json").read_text())  # what ckptd serve answered
        assert (answer["step"], answer["epoch"], answer["name_step"], answer["layout"]) == (3, 1, 3, MINDFORMERS)
        assert [(x["rank"], x["path"]) for x in answer["shards"]] == [(r, mf_shard(d, r, 1, 3)) for r in range(2)]
        assert answer["mindformers"]["load_checkpoint"] == str(d / "checkpoint")
        assert answer["mindformers"]["resume_training"] == "llama_rank_0-1_3.ckpt"

        ref, got = th.losses(ref_tp2), th.losses(d)  # the uninterrupted job's losses, bit for bit
        assert sorted(got) == list(range(1, 9))
        assert all({h for _, h in e} == {ref[s][0][1]} for s, e in got.items())

        def newest():
            r = client.get("/v1/runs/job/resume", params={"lease": "false"})
            return r.json() if r.status_code == 200 and r.json()["global_step"] == 8 else None

        final = wait_for(newest, 60, interval=0.2, what="the restart's last save answered")
        assert (final["incarnation"], final["epoch"], final["name_step"]) == (1, 2, 4)
        assert [x["path"] for x in final["shards"]] == [mf_shard(d, r, 2, 4, k=1) for r in range(2)]
    finally:
        client.close()
        stop_process(proc)
