"""MFJob against MindFormers 2.1.0's OWN code.

* Always: against the committed trees in tests/fixtures/mindformers/ (written by MindFormers'
  CheckpointMonitor and resume_ckpt.py on CPU; see its README.md).
* When MindFormers is installed (the Makefile installs it): MindFormers' CheckpointMonitor runs a
  real ``Model.train`` into tmp_path (three incarnations, so ``_1``/``_2`` restart prefixes and a
  breakpoint), and the tree must equal MFJob's -- names, directories, modes, key order, dtypes,
  append values, meta.json; and MindFormers' ``get_resume_checkpoint_by_meta`` must give the answers
  recorded in ``mf_fixtures.RESUME_SCENARIOS``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from mf_fixtures import (
    RESUME_SCENARIOS, MFJob, ckpt_name_re, mindformers_available, mindformers_resume_choice,
    mindformers_resume_many, mindformers_train,
)

FIXTURES = Path(__file__).parent / "fixtures" / "mindformers"
needs_mindformers = pytest.mark.skipif(not mindformers_available(),
                                       reason="mindformers 2.1.0 not installed (make test installs it)")


def tree(root: Path) -> dict[str, str]:
    """relative path -> "d" / "f" for everything under root."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "d"
        for f in files:
            out[os.path.relpath(os.path.join(dirpath, f), root)] = "f"
    return out


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def read(ms, path: Path) -> dict[str, np.ndarray]:
    fmt = "safetensors" if path.suffix == ".safetensors" else "ckpt"
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(str(path), format=fmt).items()}


def shape_of_keys(keys: list[str], weights: set[str]) -> list[str]:
    """File key order with parameter names abstracted: W (weights), M/V (moments), other keys as is,
    consecutive repeats collapsed -- comparable across networks with different parameter names."""
    out: list[str] = []
    for k in keys:
        c = "M" if k.startswith("adam_m.") else "V" if k.startswith("adam_v.") else "W" if k in weights else k
        if not out or out[-1] != c:
            out.append(c)
    return out


def non_weights(d: dict[str, np.ndarray], weights: set[str]) -> dict[str, tuple]:
    return {k: (v.dtype.str, v.shape) for k, v in d.items()
            if k not in weights and not k.startswith(("adam_m.", "adam_v."))}


# --- committed MindFormers-written fixtures -----------------------------------------------------------


def test_committed_legacy_tree_matches_generator(ms, tmp_path):
    """make_samples.py part A (CheckpointMonitor, 2x6 steps, save every 2, keep 2, network copies; then a
    restart saving every 3 with exception_save failing at step 4), replayed with MFJob."""
    src = FIXTURES / "legacy"
    run = tmp_path / "run"
    first = MFJob(run, tp=1, dp=1, prefix="toy", steps_per_epoch=6, global_batch_size=1)
    for g in (10, 12):  # keep_checkpoint_max=2 rotated away everything before 2_4 (global step 10)
        first.save(g)
        first.network_copy(g)
    second = MFJob(run, tp=1, dp=1, prefix="toy", steps_per_epoch=6, restart=1, global_batch_size=None)
    second.save(3)
    second.save(4, breakpoint=True)
    assert tree(run) == tree(src)
    assert json.loads((run / "checkpoint/rank_0/meta.json").read_text()) == \
        json.loads((src / "checkpoint/rank_0/meta.json").read_text())
    mf_weights = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    our_weights = {p.name for p in first.params()}
    for rel, kind in tree(src).items():
        if kind != "f" or not rel.endswith(".ckpt"):
            continue
        theirs, ours = read(ms, src / rel), read(ms, run / rel)
        assert shape_of_keys(list(ours), our_weights) == shape_of_keys(list(theirs), mf_weights), rel
        assert non_weights(ours, our_weights) == non_weights(theirs, mf_weights), rel
        for k in ("epoch_num", "step_num", "loss_scale", "global_batch_size", "global_step"):
            if k in theirs:
                np.testing.assert_array_equal(ours[k], theirs[k], err_msg=f"{rel}:{k}")
    # the breakpoint appends the step within the epoch; the network copy carries no append_dict
    assert int(read(ms, src / "checkpoint/rank_0/toy_rank_0-1_4_breakpoint.ckpt")["step_num"]) == 4
    assert set(read(ms, src / "checkpoint_network/rank_0/toy_rank_0-network-2_6.ckpt")) == mf_weights


def test_committed_safetensors_tree_matches_generator(ms, tmp_path):
    from safetensors import safe_open

    src = FIXTURES / "legacy_safetensors"
    run = tmp_path / "run"
    job = MFJob(run, tp=1, dp=1, prefix="toy", fmt="safetensors", steps_per_epoch=6, global_batch_size=None)
    job.save(3), job.save(6)
    assert tree(run) == tree(src)
    assert json.loads((run / "checkpoint/rank_0/meta.json").read_text()) == \
        json.loads((src / "checkpoint/rank_0/meta.json").read_text())
    mf_weights = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    for name in ("toy_rank_0-1_3.safetensors", "toy_rank_0-1_6.safetensors"):
        a, b = src / "checkpoint/rank_0" / name, run / "checkpoint/rank_0" / name
        with safe_open(str(a), framework="np") as fa, safe_open(str(b), framework="np") as fb:
            assert fa.metadata() == fb.metadata() == {"format": "ms", "remove_redundancy": "False"}
        theirs, ours = read(ms, a), read(ms, b)
        assert non_weights(ours, {p.name for p in job.params()}) == non_weights(theirs, mf_weights)
        for k in ("epoch_num", "step_num", "loss_scale", "global_step"):
            np.testing.assert_array_equal(ours[k], theirs[k])


def test_committed_resume_demo_matches_recorded_scenario(tmp_path):
    """make_samples.py part E: MindFormers' resume_ckpt.py ran on this tree; its record's last line is the
    answer. MFJob's "resume_demo" scenario builds the same names and meta.json files."""
    src = FIXTURES / "resume_demo"
    scenario = next(s for s in RESUME_SCENARIOS if s.name == "resume_demo")
    run = tmp_path / "run"
    scenario.build(run)
    assert tree(run / "checkpoint") == tree(src / "checkpoint")
    for r in range(4):
        rel = f"checkpoint/rank_{r}/meta.json"
        assert json.loads((run / rel).read_text()) == json.loads((src / rel).read_text())
    record = (src / "output/resume_record/latest_checkpointed_iteration.txt").read_text().split()
    assert [os.path.basename(line) for line in record] == ["toy_rank_0-1_2.ckpt", "toy_rank_0-1_4.ckpt"]
    assert os.path.basename(record[-1]) == scenario.mindformers
    health = json.loads((src / "output/health_ckpts.json").read_text())
    assert health == [{"is_health": 0, "ckpt_name": "toy_rank_0-1_2.ckpt"},
                      {"is_health": 1, "ckpt_name": "toy_rank_0-1_4.ckpt"}]


# --- live MindFormers ----------------------------------------------------------------------------------


@needs_mindformers
def test_checkpoint_monitor_writes_what_mfjob_writes(ms, tmp_path):
    """Three incarnations of a 2-rank (dp=2) job into one directory, by MindFormers and by MFJob."""
    from safetensors import safe_open

    mf_run, our_run, work = tmp_path / "mf", tmp_path / "ours", tmp_path / "work"
    job = MFJob(our_run, tp=1, dp=2, prefix="toy", steps_per_epoch=6, global_batch_size=8)
    params = [(p.name, p.shape) for p in job.params()]
    common = dict(params=params, prefix="toy", steps_per_epoch=6, ranks=(0, 1), global_batch_size=8, work_dir=work)

    # 1: 2 epochs, save every 2 steps, network copies
    mindformers_train(mf_run, epochs=2, save_steps=2, network=True, **common)
    for g in range(2, 13, 2):
        job.save(g)
        job.network_copy(g)
    # 2: restart (prefix _1), save every 3, exception_save after a failure at global step 8 (epoch 2 step 2)
    mindformers_train(mf_run, epochs=2, save_steps=3, raise_at=8, **common)
    job1 = MFJob(our_run, tp=1, dp=2, prefix="toy", steps_per_epoch=6, global_batch_size=8, restart=1)
    job1.save(3), job1.save(6), job1.save(8, breakpoint=True)
    # 3: restart again (prefix _2), safetensors
    mindformers_train(mf_run, epochs=1, save_steps=3, fmt="safetensors", **common)
    job2 = MFJob(our_run, tp=1, dp=2, prefix="toy", steps_per_epoch=6, global_batch_size=8, restart=2,
                 fmt="safetensors")
    job2.save(3), job2.save(6)

    mf_tree, our_tree = tree(mf_run), tree(our_run)
    assert our_tree == mf_tree
    assert "checkpoint/rank_1/toy_rank_1-2_2_breakpoint.ckpt" in mf_tree  # breakpoints: no restart suffix
    assert "checkpoint/rank_0/toy_rank_0_2-1_6.safetensors" in mf_tree
    for rel in mf_tree:
        assert mode(mf_run / rel) == mode(our_run / rel), rel
    for r in (0, 1):
        rel = f"checkpoint/rank_{r}/meta.json"
        assert json.loads((our_run / rel).read_text()) == json.loads((mf_run / rel).read_text()) == {
            "last_epoch": 1, "last_step": 6, "last_ckpt_file": f"toy_rank_{r}_2-1_6.safetensors"}
    weights = {p.name for p in job.params()}
    for rel, kind in mf_tree.items():
        if kind != "f" or rel.endswith("meta.json"):
            continue
        path = mf_run / rel
        assert ckpt_name_re(path.suffix[1:]).match(path.name.replace("-network", "")) or "_breakpoint" in rel
        theirs, ours = read(ms, path), read(ms, our_run / rel)
        assert list(ours) == list(theirs), rel  # same keys in the same order (safetensors: sorted)
        assert {k: (v.dtype.str, v.shape) for k, v in ours.items()} == \
            {k: (v.dtype.str, v.shape) for k, v in theirs.items()}, rel
        for k in ("epoch_num", "step_num", "loss_scale", "global_batch_size", "global_step"):
            if k in theirs or k in ours:
                np.testing.assert_array_equal(ours[k], theirs[k], err_msg=f"{rel}:{k}")
        if "checkpoint_network" in rel:
            assert set(theirs) == weights
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="np") as fa, safe_open(str(our_run / rel), framework="np") as fb:
                assert fa.metadata() == fb.metadata()
    bp = read(ms, mf_run / "checkpoint/rank_0/toy_rank_0-2_2_breakpoint.ckpt")
    assert (int(bp["epoch_num"]), int(bp["step_num"]), bp["global_step"].tolist()) == (2, 2, [8])


@needs_mindformers
def test_mindformers_resume_answers_are_the_recorded_ones(tmp_path):
    cases, runs = [], []
    for s in RESUME_SCENARIOS:
        run = tmp_path / s.name
        job = s.build(run)
        cases.append((s.checkpoint_dir(run), job.world, s.fmt))
        runs.append(run)
    demo = tmp_path / "committed_resume_demo"
    shutil.copytree(FIXTURES / "resume_demo" / "checkpoint", demo)
    cases.append((demo, 4, "ckpt"))
    results = mindformers_resume_many(cases, work_dir=tmp_path / "work")
    for s, run, res in zip(RESUME_SCENARIOS, runs, results):
        outcome = "error" if res["error"] else "no_meta" if res["no_meta"] else "file"
        assert (outcome, res["choice"]) == (s.outcome, s.mindformers), (s.name, res)
        if outcome == "file":  # every rank resumes the same step, its own rank substituted
            assert res["per_rank"] == {str(r): s.mindformers.replace("_rank_0", f"_rank_{r}", 1)
                                       for r in range(len(res["per_rank"]))}
            assert res["record"].splitlines()[-1] == str(s.checkpoint_dir(run).resolve() / "rank_0" / s.mindformers)
    assert results[-1]["choice"] == "toy_rank_0-1_4.ckpt"  # the committed tree, as recorded in 2.1.0's run


@needs_mindformers
def test_mindformers_resume_choice_helper(tmp_path):
    job = MFJob(tmp_path, tp=2, dp=2)
    job.save(10), job.save(20), job.save(30, ranks=[0, 1, 2])
    assert mindformers_resume_choice(tmp_path / "checkpoint", job.world) == "llama_rank_0-1_20.ckpt"
