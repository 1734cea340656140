"""``ckptd convert`` on MindFormers output directories (and lying source strategies there).

MindFormers writes ``<out>/checkpoint/rank_<r>/{P}_rank_<r>[_{k}]-{E}_{S}.ckpt`` next to
``meta.json`` and ``..._breakpoint.ckpt`` saves, and one strategy file per rank,
``<out>/strategy/ckpt_strategy_rank_<r>.ckpt`` (under pipeline parallelism each holds only its
stage). Sources here are written with ``mindspore.save_checkpoint`` at those names; results are
compared bitwise with the same data converted from native ``rank_<r>/`` names, with
``mindspore.transform_checkpoints`` and with the ground truth.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from test_convert_helpers import (
    Spec,
    build_strategy,
    expected_rank,
    full_tensors,
    read_dir,
    write_sources,
    write_strategy,
)

from ckptd.cli.convert_cmd import main as cli_main
from ckptd.convert import ConvertError, convert, find_source_files, plan_from_dir
from ckptd.format.strategy import OpItem, ParamStrategy, Strategy, save_strategy

PREFIX = "llama"


def mf_name(rank: int, epoch: int, step: int, *, k: int = 0, breakpoint: bool = False) -> str:
    """MindFormers' shard name, spelled out here (not built by ckptd) so the test pins the contract."""
    tag = f"{PREFIX}_rank_{rank}" + (f"_{k}" if k else "")
    return f"{tag}-{epoch}_{step}" + ("_breakpoint" if breakpoint else "") + ".ckpt"


def write_mf_run(ms, out: Path, spec: Spec, full, *, epoch: int = 1, step: int = 10, k: int = 0,
                 noise: bool = True, stage_strategies: bool = True) -> None:
    """A MindFormers output directory of ``spec``: shards at MindFormers names, ``meta.json``, a
    breakpoint save holding *other* data (so picking it by mistake shows) and per-rank strategies."""
    ckpt = out / "checkpoint"
    write_sources(ms, ckpt, spec, full, step_name="tmp.ckpt")
    if noise:
        write_sources(ms, ckpt, spec, full_tensors(99), step_name="bp.ckpt")
    for rank in range(spec.world):
        d = ckpt / f"rank_{rank}"
        os.rename(d / "tmp.ckpt", d / mf_name(rank, epoch, step, k=k))
        if noise:
            os.rename(d / "bp.ckpt", d / mf_name(rank, epoch, step + 3, breakpoint=True))
            (d / "meta.json").write_text(json.dumps({"last_epoch": epoch, "last_step": step,
                                                     "last_ckpt_file": mf_name(rank, epoch, step, k=k)}))
    if stage_strategies:
        write_rank_strategies(out / "strategy", spec)


def write_rank_strategies(directory: Path, spec: Spec) -> None:
    """``ckpt_strategy_rank_<r>.ckpt`` per rank, each holding only its stage (MindSpore's
    per-stage file: unmerged names, the stage in its operator items)."""
    merged = build_strategy(spec)
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(spec.world):
        stage, _ = merged.stage_and_local(rank)
        entries = [ParamStrategy(e.name, e.layout, stage) for e in merged.entries if e.stage == stage]
        ops = [OpItem(f"Default/network-stage{stage}/MatMul-op{stage}", stage, ((spec.dp, spec.tp),))]
        save_strategy(Strategy.build(entries, op_items=ops), directory / f"ckpt_strategy_rank_{rank}.ckpt")


def check_truth(out: Path, spec: Spec | None, full) -> dict:
    got = read_dir(out)
    world = spec.world if spec is not None else 1
    assert sorted(got) == list(range(world))
    for rank in range(world):
        for name, raw in expected_rank(spec, full, rank).items():
            assert got[rank][name][1] == raw, (rank, name)
    return got


def test_mindformers_names_convert_bitwise_like_native_names(ms, tmp_path):
    """tp2 x dp2 at MindFormers names (+ meta.json, a breakpoint save) -> tp4, from ``<out>`` and
    from ``<out>/checkpoint``: the same bytes as from native names, as MindSpore's transform, as
    the ground truth."""
    src, dst = Spec(2, 2), Spec(4)
    full = full_tensors(21)
    write_mf_run(ms, tmp_path / "mf", src, full)
    write_sources(ms, tmp_path / "native", src, full)
    sa = write_strategy(src, tmp_path / "a.ckpt")
    sb = write_strategy(dst, tmp_path / "b.ckpt")
    files = find_source_files(tmp_path / "mf")
    assert {r: Path(p).name for r, p in files.items()} == {r: mf_name(r, 1, 10) for r in range(4)}
    assert find_source_files(tmp_path / "mf" / "checkpoint") == files
    assert cli_main(["convert", "--src", str(tmp_path / "mf"), "--src-strategy", sa, "--to-layout", "tp=4,dp=1",
                     "--out", str(tmp_path / "from_out")]) == 0
    convert(tmp_path / "mf" / "checkpoint", sa, sb, tmp_path / "from_ckpt_dir")
    convert(tmp_path / "native", sa, sb, tmp_path / "from_native")
    native = check_truth(tmp_path / "from_native", dst, full)
    assert read_dir(tmp_path / "from_out") == native
    assert read_dir(tmp_path / "from_ckpt_dir") == native
    ms.transform_checkpoints(str(tmp_path / "native"), str(tmp_path / "ms"), "checkpoint_", sa, sb)
    theirs = read_dir(tmp_path / "ms")
    for rank, entries in theirs.items():
        for name, value in entries.items():
            if name != "rank_id":  # ckptd sets it to the destination rank on purpose
                assert native[rank][name] == value, (rank, name)


def test_breakpoint_saves_only_when_step_names_one(ms, tmp_path):
    spec = Spec(2)
    full = full_tensors(5)
    write_mf_run(ms, tmp_path / "mf", spec, full, step=10)
    sa = write_strategy(spec, tmp_path / "a.ckpt")
    # --step 10 never matches the breakpoint save of step 13, nor does --step 13
    picked = find_source_files(tmp_path / "mf", 10)
    assert [Path(p).name for p in picked.values()] == [mf_name(0, 1, 10), mf_name(1, 1, 10)]
    with pytest.raises(ConvertError, match=r"no checkpoint of step 13\b.*1_13_breakpoint"):
        find_source_files(tmp_path / "mf", 13)
    convert(tmp_path / "mf", sa, None, tmp_path / "bp", step="1_13_breakpoint")
    check_truth(tmp_path / "bp", None, full_tensors(99))
    # a directory holding breakpoint saves only: refused without --step, with the way to name one
    for rank in range(2):
        os.remove(tmp_path / "mf" / "checkpoint" / f"rank_{rank}" / mf_name(rank, 1, 10))
    with pytest.raises(ConvertError, match=r"no rank_<N>/ directory.*only breakpoint saves.*1_13_breakpoint"):
        find_source_files(tmp_path / "mf")


def test_restart_incarnations_and_mixed_saves(ms, tmp_path):
    """A restart into the same output dir saves ``llama_rank_<r>_1-1_10.ckpt`` next to the first
    run's step 10: ``--step 1_10`` is ambiguous, ``--step llama_1-1_10`` picks the restart; ranks
    whose picked files are of different saves are refused."""
    spec = Spec(2)
    first, second = full_tensors(1), full_tensors(2)
    write_mf_run(ms, tmp_path / "mf", spec, first, noise=False, stage_strategies=False)
    write_mf_run(ms, tmp_path / "mf", spec, second, k=1, noise=False, stage_strategies=False)
    sa = write_strategy(spec, tmp_path / "a.ckpt")
    with pytest.raises(ConvertError, match=r"several checkpoints.*llama-1_10, llama_1-1_10"):
        find_source_files(tmp_path / "mf", "1_10")
    convert(tmp_path / "mf", sa, None, tmp_path / "restart", step="llama_1-1_10")
    check_truth(tmp_path / "restart", None, second)
    convert(tmp_path / "mf", sa, None, tmp_path / "first", step="llama-1_10")
    check_truth(tmp_path / "first", None, first)
    # rank 1 lost the first run's file: without --step each rank has one file, of different saves
    os.remove(tmp_path / "mf" / "checkpoint" / "rank_1" / mf_name(1, 1, 10))
    os.remove(tmp_path / "mf" / "checkpoint" / "rank_0" / mf_name(0, 1, 10, k=1))
    with pytest.raises(ConvertError, match=r"different saves.*rank\(s\) 0: llama_rank_0-1_10\.ckpt.*"
                                           r"rank\(s\) 1: llama_rank_1_1-1_10\.ckpt"):
        plan_from_dir(tmp_path / "mf", sa, None)


def test_a_file_of_another_rank_is_not_taken_for_this_ranks(ms, tmp_path):
    """``rank_1/llama_rank_0-1_10.ckpt`` (copied from rank 0): its rank tag names another rank, so
    it is not of rank 1's save -- refused, not converted as rank 1's data."""
    spec = Spec(2)
    write_mf_run(ms, tmp_path / "mf", spec, full_tensors(3), noise=False, stage_strategies=False)
    ckpt = tmp_path / "mf" / "checkpoint"
    os.remove(ckpt / "rank_1" / mf_name(1, 1, 10))
    (ckpt / "rank_1" / mf_name(0, 1, 10)).write_bytes((ckpt / "rank_0" / mf_name(0, 1, 10)).read_bytes())
    with pytest.raises(ConvertError, match=r"different saves.*rank\(s\) 1: llama_rank_0-1_10\.ckpt"):
        find_source_files(tmp_path / "mf")
    with pytest.raises(ConvertError, match=r"different saves"):
        find_source_files(tmp_path / "mf", "1_10")
    with pytest.raises(ConvertError, match=r"no checkpoint of step llama-1_10 in \S*rank_1 "):
        find_source_files(tmp_path / "mf", "llama-1_10")


def test_lying_strategy_on_a_mindformers_run_is_refused_and_nothing_written(ms, tmp_path, capsys):
    """tp2 x dp2 MindFormers run, converted with a tp4 strategy of the same parameters: every
    shard has the shape a tp4 shard of a 2x larger tensor would have, so only the bytes tell."""
    full = full_tensors(4)
    write_mf_run(ms, tmp_path / "mf", Spec(2, 2), full)
    lie = write_strategy(Spec(4), tmp_path / "tp4.ckpt")
    pre = tmp_path / "pre"
    pre.mkdir()
    (pre / "notes.txt").write_text("mine")
    for out, target in ((tmp_path / "out", ["--to-layout", "tp=4,dp=1"]), (pre, ["--to-strategy", "none"])):
        rc = cli_main(["convert", "--src", str(tmp_path / "mf"), "--src-strategy", lie, *target, "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 1, err
        assert re.search(r"rank 2: holds the same bytes as rank 0 in \d+ parameter\(s\) 'embedding', 'w1'", err), err
        assert re.search(r"rank 3: holds the same bytes as rank 1 in", err), err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in pre.iterdir()) == ["notes.txt"] and (pre / "notes.txt").read_text() == "mine"
    # --plan refuses the same way
    assert cli_main(["convert", "--src", str(tmp_path / "mf"), "--src-strategy", lie, "--to-strategy", "none",
                     "--plan"]) == 1


def test_strategy_directory_without_the_merge_module_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    from ckptd.convert import resolve_strategy

    write_rank_strategies(tmp_path / "strategy", Spec(2, pp=2))
    monkeypatch.setitem(sys.modules, "ckptd.format.strategy_merge", None)  # as if it were not installed
    with pytest.raises(ConvertError, match="per-rank strategy files needs ckptd.format.strategy_merge"):
        resolve_strategy(tmp_path / "strategy")


@pytest.mark.parametrize("src", [Spec(2, pp=2), Spec(2, 2)], ids=["tp2pp2", "tp2dp2"])
def test_per_rank_strategy_directory_converts_to_tp1(ms, tmp_path, src):
    """``--src-strategy <out>/strategy``: the per-rank (per-stage) files are merged; the tp2 x pp2
    run converts to tp=1 (pp=1) like MindSpore's merge_pipeline_strategys + transform_checkpoints."""
    pytest.importorskip("ckptd.format.strategy_merge")
    from ckptd.convert import resolve_strategy
    from ckptd.format.strategy import load_strategy

    full = full_tensors(13)
    write_mf_run(ms, tmp_path / "mf", src, full)
    dst = Spec(1)
    sb = write_strategy(dst, tmp_path / "tp1.ckpt")
    merged = resolve_strategy(tmp_path / "mf" / "strategy")
    assert merged.content_hash() == build_strategy(src).content_hash()
    assert cli_main(["convert", "--src", str(tmp_path / "mf"), "--src-strategy", str(tmp_path / "mf" / "strategy"),
                     "--to-strategy", sb, "--out", str(tmp_path / "ours")]) == 0
    ours = check_truth(tmp_path / "ours", dst, full)
    # MindSpore: merge the stage files, then transform (it reads <out>/checkpoint/rank_<r>/*.ckpt,
    # so the breakpoint saves go first: it would pick one of several files by itself)
    for rank in range(src.world):
        os.remove(tmp_path / "mf" / "checkpoint" / f"rank_{rank}" / mf_name(rank, 1, 13, breakpoint=True))
    ms.merge_pipeline_strategys(str(tmp_path / "mf" / "strategy"), str(tmp_path / "ms_merged.ckpt"))
    assert load_strategy(tmp_path / "ms_merged.ckpt").content_hash() == merged.content_hash() or src.pp == 1
    ms.transform_checkpoints(str(tmp_path / "mf" / "checkpoint"), str(tmp_path / "ms"), "checkpoint_",
                             str(tmp_path / "ms_merged.ckpt"), sb)
    theirs = read_dir(tmp_path / "ms")
    for name, value in theirs[0].items():
        if name != "rank_id":
            assert ours[0][name] == value, name


def test_lying_stage_files_are_refused(ms, tmp_path):
    """tp2 x pp2 shards under the per-rank strategy files of a tp2 x dp2 job (all stage 0)."""
    pytest.importorskip("ckptd.format.strategy_merge")
    write_mf_run(ms, tmp_path / "mf", Spec(2, pp=2), full_tensors(2), stage_strategies=False)
    write_rank_strategies(tmp_path / "mf" / "strategy", Spec(2, 2))
    with pytest.raises(ConvertError, match=r"rank 2: lacks 4 parameter\(s\) 'embedding'") as info:
        plan_from_dir(tmp_path / "mf", tmp_path / "mf" / "strategy", None)
    assert "rank 0: lacks 4 parameter(s) 'w2'" in str(info.value)
    assert not np.any([p.name.startswith("out") for p in tmp_path.iterdir()])
