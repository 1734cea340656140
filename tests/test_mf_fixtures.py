"""The MindFormers legacy fixture generator (tests/mf_fixtures.py) is faithful: names parse with
MindFormers' own patterns, MindSpore reads every file back, slices/stages/redundancy subsets agree
with MindSpore's own functions, strategy files load in ckptd and merge in MindSpore."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from mf_fixtures import (
    APPEND_KEYS, CKPT_MODE, DIR_MODE, FILE_MODE, RANK_RE, MFJob, ckpt_name_re, model_params, tear, write_health,
)

# MindFormers tools/utils.py get_epoch_and_step_from_ckpt_name
EPOCH_STEP = r"-(\d+)_(\d+)\."


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def load(ms, path, fmt="ckpt") -> dict[str, np.ndarray]:
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(str(path), format=fmt).items()}


def test_names_parse_with_mindformers_patterns(ms, tmp_path):
    import re

    from mindspore.train.callback._checkpoint import _chg_ckpt_file_name_if_same_exist

    for fmt in ("ckpt", "safetensors"):
        run = tmp_path / fmt
        for restart in (0, 1, 2):
            job = MFJob(run, tp=2, dp=1, fmt=fmt, steps_per_epoch=7, restart=restart, prefix="llm")
            for r in range(job.world if restart else 0):  # MindSpore's own scan names this incarnation
                assert _chg_ckpt_file_name_if_same_exist(str(job.rank_dir(r)), f"llm_rank_{r}") == job.rank_prefix(r)
            for g, (e, s) in {1: (1, 1), 7: (1, 7), 8: (2, 1), 15: (3, 1)}.items():
                paths = job.save(g)
                for r, p in paths.items():
                    assert p == run / "checkpoint" / f"rank_{r}" / p.name
                    assert ckpt_name_re(fmt).match(p.name), p.name
                    assert int(RANK_RE.search(p.name).group(1)) == r
                    assert tuple(map(int, re.search(EPOCH_STEP + fmt, p.name).groups())) == (e, s)
                    suffix = f"_{restart}" if restart else ""
                    assert p.name == f"llm_rank_{r}{suffix}-{e}_{s}.{fmt}"
            # the next incarnation's prefix, as MindSpore's ModelCheckpoint would compute it
            for r in range(job.world):
                assert _chg_ckpt_file_name_if_same_exist(str(job.rank_dir(r)), f"llm_rank_{r}") == \
                    f"llm_rank_{r}_{restart + 1}"
    bp = MFJob(tmp_path / "bp", steps_per_epoch=7, restart=2).save(9, ranks=[1], breakpoint=True)[1]
    assert bp.name == "llama_rank_1-2_2_breakpoint.ckpt"
    assert not ckpt_name_re("ckpt").match(bp.name)  # resume never considers breakpoints


def test_every_file_loads_with_expected_keys_values_and_modes(ms, tmp_path):
    job = MFJob(tmp_path, tp=2, dp=2, steps_per_epoch=50, global_batch_size=16)
    paths = job.save(120)
    full = job.full_tensors(120)
    assert sorted(paths) == [0, 1, 2, 3]
    for r, path in paths.items():
        got = load(ms, path)
        assert list(got) == job.expected_keys(r)  # file order: weights, global_step, lr, adam_m, adam_v, append
        want = job.tensors(r, 120)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            np.testing.assert_array_equal(got[k], v)
        assert got["global_step"].dtype == np.int32 and got["global_step"].tolist() == [120]
        assert got["learning_rate"].shape == () and got["learning_rate"].dtype == np.float32
        for k in APPEND_KEYS:
            assert got[k].shape == () and got[k].dtype == np.int64, k
        assert (int(got["epoch_num"]), int(got["step_num"]), int(got["loss_scale"]),
                int(got["global_batch_size"])) == (3, 120, 1, 16)
        # slices of the deterministic full tensors: tp index = r % tp; dp replicas equal
        assert np.array_equal(got["model.layers.0.attention.wq.weight"],
                              full["model.layers.0.attention.wq.weight"][(r % 2) * 4:(r % 2) * 4 + 4])
        assert np.array_equal(got["adam_v.model.layers.1.attention.wo.weight"],
                              full["adam_v.model.layers.1.attention.wo.weight"][:, (r % 2) * 4:(r % 2) * 4 + 4])
        assert path.name == f"llama_rank_{r}-3_20.ckpt"
        assert mode(path) == CKPT_MODE and mode(path.parent) == DIR_MODE
        meta = job.meta_path(r)
        assert mode(meta) == FILE_MODE
        assert json.loads(meta.read_text()) == {"last_epoch": 3, "last_step": 20, "last_ckpt_file": path.name}
        assert sorted(os.listdir(path.parent)) == [path.name, "meta.json"]  # no .tmp left behind
    for a, b in ((0, 2), (1, 3)):  # dp replicas hold identical data
        assert all(np.array_equal(x, y) for x, y in zip(load(ms, paths[a]).values(), load(ms, paths[b]).values()))
    # deterministic in (seed, name, step), independent of topology
    assert all(np.array_equal(v, MFJob(tmp_path / "x", tp=1, dp=1).full_tensors(120)[k]) for k, v in full.items())
    assert not all(np.array_equal(v, MFJob(tmp_path / "y", seed=1).full_tensors(120)[k]) for k, v in full.items())
    float_scale = MFJob(tmp_path / "f", tp=1, dp=1, loss_scale=1024.0, global_batch_size=None).save(3)[0]
    got = load(ms, float_scale)
    assert got["loss_scale"].dtype == np.float32 and float(got["loss_scale"]) == 1024.0
    assert "global_batch_size" not in got


def test_slices_agree_with_mindspore_load_tensor(ms, tmp_path):
    from mindspore.parallel._tensor import _load_tensor

    job = MFJob(tmp_path, tp=4, dp=2, pp=2)
    full = job.full_tensors(5)
    for r in range(job.world):
        local = job.tensors(r, 5)
        for prefix in ("", "adam_m.", "adam_v."):
            for p in job.params(job.stage_of(r)):
                want = _load_tensor(ms.Tensor(full[prefix + p.name]), [job.dp, job.tp], list(job.tensor_map(p)),
                                    rank_id=job.local_rank(r))
                np.testing.assert_array_equal(local[prefix + p.name], want)


def test_pipeline_ranks_hold_only_their_stage_and_strategies_merge(ms, tmp_path):
    from ckptd.format.strategy import load_strategy
    from mindspore.train._utils import get_parameter_redundancy

    job = MFJob(tmp_path, tp=2, dp=2, pp=2)
    files = job.strategy_files()
    assert [f.name for f in files] == [f"ckpt_strategy_rank_{r}.ckpt" for r in range(8)]
    paths = job.save(10)
    stage_names = {s: {p.name for p in model_params(2) if p.stage == s} for s in (0, 1)}
    assert stage_names[0] == {"model.tok_embeddings.embedding_weight"} | {
        f"model.layers.0.attention.{n}.weight" for n in ("wq", "wo")} | {"model.layers.0.attention_norm.weight"}
    assert {"lm_head.weight", "model.norm_out.weight", "model.layers.1.attention.wq.weight"} <= stage_names[1]
    seen = set()
    for r, path in paths.items():
        stage = r // 4
        keys = set(load(ms, path))
        weights = {k for k in keys
                   if not k.startswith(("adam_", "global_step", "learning_rate")) and k not in APPEND_KEYS}
        assert weights == stage_names[stage], r
        assert {k[7:] for k in keys if k.startswith("adam_m.")} == stage_names[stage]
        seen |= weights
        s = load_strategy(files[r])
        assert {e.stage for e in s.entries} == {stage} and not s.merged and s.stage_device_num == 4
        assert set(s.params) == {pre + n for pre in ("", "adam_m.", "adam_v.") for n in stage_names[stage]}
        slices = s.slices_for_rank(r, job.full_shapes())
        local = job.tensors(r, 10)
        for name, sl in slices.items():
            assert sl.sizes == local[name].shape, name
        # MindSpore's own parser of our file agrees with the redundancy MFJob uses
        assert get_parameter_redundancy(str(files[r]), stage * 4) == job.redundancy(r)
    assert seen == {p.name for p in model_params(2)}
    merged = tmp_path / "merged" / "merged_ckpt_strategy.ckpt"
    ms.merge_pipeline_strategys(str(job.strategy_dir), str(merged))
    m = load_strategy(merged)
    assert m.merged and m.stages == 2 and m.world_size == 8
    assert {(e.stage, e.name) for e in m.entries} == {
        (s, pre + n) for s in (0, 1) for pre in ("", "adam_m.", "adam_v.") for n in stage_names[s]}


@pytest.mark.parametrize("tp,dp,pp", [(2, 2, 1), (2, 2, 2), (1, 4, 1)])
def test_remove_redundancy_subsets_cover_every_parameter(ms, tmp_path, tp, dp, pp):
    from safetensors import safe_open
    from mindspore.train._utils import get_parameter_redundancy, remove_param_redundancy

    job = MFJob(tmp_path, tp=tp, dp=dp, pp=pp, fmt="safetensors", remove_redundancy=True)
    strategies = job.strategy_files()
    paths = job.save(7)
    per_stage: dict[int, set[str]] = {}
    for r, path in paths.items():
        stage = job.stage_of(r)
        with safe_open(str(path), framework="np") as f:
            assert f.metadata() == {"format": "ms", "remove_redundancy": "True"}
        got = load(ms, path, "safetensors")
        # MindSpore's functions, fed from the strategy file on disk, decide what this rank saves
        mine = remove_param_redundancy(get_parameter_redundancy(str(strategies[r]), stage * tp * dp)).get(r, set())
        assert mine == job.saved_params(r)
        layout_names = set(job.ms_parameter_layout(stage))
        assert {k for k in got if k in layout_names} == mine
        assert {"global_step", "learning_rate", *APPEND_KEYS} <= set(got)  # no layout: every rank saves them
        local = job.tensors(r, 7)
        for k in mine:
            np.testing.assert_array_equal(got[k], local[k])
        per_stage.setdefault(stage, set()).update(mine)
    for stage, names in per_stage.items():
        assert names == set(job.ms_parameter_layout(stage)), stage  # the union covers every parameter
    if dp > 1:
        assert any(len(job.saved_params(r)) < len(job.ms_parameter_layout(job.stage_of(r))) for r in paths)
    plain = MFJob(tmp_path / "plain", tp=tp, dp=dp, pp=pp, fmt="safetensors").save(7, ranks=[0])[0]
    with safe_open(str(plain), framework="np") as f:
        assert f.metadata() == {"format": "ms", "remove_redundancy": "False"}
    assert set(load(ms, plain, "safetensors")) == set(job.expected_keys(0)) | set(job.ms_parameter_layout(0))
    with pytest.raises(ValueError, match="safetensors"):
        MFJob(tmp_path / "bad", remove_redundancy=True)


def test_peer_writes_dying_gasp_with_remove_redundancy(ms, tmp_path):
    job = MFJob(tmp_path, tp=2, dp=2, fmt="safetensors", remove_redundancy=True)
    job.save(100)
    out = job.save(200, ranks=[0, 1], peer_writes={2: 0, 3: 1})
    assert sorted(out) == [0, 1, 2, 3]
    for peer in (2, 3):
        assert out[peer] == job.path(peer, 200)
        got = load(ms, out[peer], "safetensors")
        layout_names = set(job.ms_parameter_layout(0))
        assert {k for k in got if k in layout_names} == job.saved_params(peer)
        local = job.tensors(peer, 200)
        assert all(np.array_equal(got[k], local[k]) for k in job.saved_params(peer))
        assert json.loads(job.meta_path(peer).read_text())["last_ckpt_file"] == out[peer].name
    with pytest.raises(ValueError, match="replica"):
        job.save(300, ranks=[0], peer_writes={1: 0})
    with pytest.raises(ValueError, match="remove_redundancy"):
        MFJob(tmp_path / "p").save(300, ranks=[0], peer_writes={2: 0})


def test_breakpoint_files(ms, tmp_path):
    job = MFJob(tmp_path, tp=2, dp=1, fmt="safetensors", steps_per_epoch=10, restart=1)
    job.save(12)
    before = {r: job.meta_path(r).read_text() for r in range(2)}
    bp = job.save(13, breakpoint=True)
    for r, path in bp.items():
        assert path.name == f"llama_rank_{r}-2_3_breakpoint.ckpt"  # no restart suffix, always .ckpt
        got = load(ms, path)
        assert list(got) == [k for k in job.tensors(r, 13)] + list(APPEND_KEYS)  # every parameter
        # MindSpore's _save_final_ckpt appends the step *within the epoch*
        assert (int(got["epoch_num"]), int(got["step_num"]), got["global_step"].tolist()) == (2, 3, [13])
        assert job.meta_path(r).read_text() == before[r]  # no meta.json update
        assert mode(path) == CKPT_MODE
    again = job.save(14, ranks=[0], breakpoint=True)[0]  # MindSpore's separate breakpoint scan adds _1
    assert again.name == "llama_rank_0_1-2_4_breakpoint.ckpt"


def test_network_copy_meta_health_and_tear(ms, tmp_path):
    job = MFJob(tmp_path, tp=2, dp=1, pp=2, restart=1)
    copies = job.network_copy(6)
    assert [p.relative_to(tmp_path).as_posix() for p in copies] == [
        f"checkpoint_network/rank_{r}/llama_rank_{r}_1-network-1_6.ckpt" for r in range(4)]
    for r, p in enumerate(copies):
        got = load(ms, p)
        assert list(got) == job.expected_keys(r, network=True) == [q.name for q in job.params(r // 2)]
        local = job.tensors(r, 6)
        assert all(np.array_equal(v, local[k]) for k, v in got.items())
    meta = job.write_meta(3, 1, 4, "llama_rank_3_1-1_4.ckpt")
    assert json.loads(meta.read_text()) == {"last_epoch": 1, "last_step": 4,
                                            "last_ckpt_file": "llama_rank_3_1-1_4.ckpt"}
    assert mode(meta) == FILE_MODE and mode(meta.parent) == DIR_MODE
    health = write_health(tmp_path, [("llama_rank_0-1_2.ckpt", 0), ("llama_rank_0-1_4.ckpt", 1)])
    assert health == tmp_path / "health_ckpts.json"
    assert json.loads(health.read_text()) == [{"is_health": 0, "ckpt_name": "llama_rank_0-1_2.ckpt"},
                                              {"is_health": 1, "ckpt_name": "llama_rank_0-1_4.ckpt"}]
    path = job.save(6, ranks=[0])[0]
    size = path.stat().st_size
    tear(path, 0.5)
    assert path.stat().st_size == size // 2 and mode(path) == CKPT_MODE
    with pytest.raises(Exception):
        ms.load_checkpoint(str(path))
