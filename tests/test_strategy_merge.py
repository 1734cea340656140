"""Per-rank strategy files -> the whole job's layout, against mindspore.merge_pipeline_strategys."""

from __future__ import annotations

import os
import re
import shutil
import threading

import pytest

from ckptd.errors import StrategyError
from ckptd.format import strategy_merge
from ckptd.format.layout import TensorLayout
from ckptd.format.strategy import (
    OpItem,
    ParamStrategy,
    Strategy,
    encode_strategy,
    load_strategy,
    parse_strategy_bytes,
    save_strategy,
)
from ckptd.format.strategy_merge import load_rank_strategies, merge_rank_strategies


def stage_strategy(stage: int, dp: int, tp: int, pp: int, *, path: str | None = None, **overrides) -> Strategy:
    """What one rank of ``stage`` saves in a dp x tp x pp job: its stage's layers, the embedding
    (tied: in the first and the last stage), the head in the last. ``overrides``: name -> layout."""
    dev = (dp, tp)
    opt = {"opt_shard_step": tp, "opt_shard_size": -1} if dp > 1 else {}  # optimizer shard over dp
    layouts = {}
    if stage in (0, pp - 1):
        layouts["embed"] = TensorLayout(dev, (0, -1), **opt)  # vocab rows over tp
    layouts[f"layers.{stage}.wq"] = TensorLayout(dev, (-1, 0), **opt)
    layouts[f"layers.{stage}.norm"] = TensorLayout(dev, (-1,))
    if stage == pp - 1:
        layouts["head"] = TensorLayout(dev, (0, -1))
    layouts.update(overrides)
    ops = [OpItem(f"Default/network-Net/stage{stage}/MatMul-op{stage}", stage, (dev, (tp, 1)))]
    entries = [ParamStrategy(n, lay, stage) for n, lay in layouts.items() if lay is not None]
    return Strategy.build(entries, op_items=ops, source_path=path)


def rank_name(rank: int, ext: str = "ckpt") -> str:
    return f"ckpt_strategy_rank_{rank}.{ext}"  # MindFormers' name (strategy_ckpt_save_file = ckpt_strategy.ckpt)


def job(dp: int, tp: int, pp: int, directory: str = "/run/strategy") -> dict[int, Strategy]:
    d = dp * tp
    return {r: stage_strategy(r // d, dp, tp, pp, path=os.path.join(directory, rank_name(r))) for r in range(pp * d)}


def write_job(directory, per_rank: dict[int, Strategy], ext: str = "ckpt") -> None:
    directory.mkdir(exist_ok=True)
    for rank, s in per_rank.items():
        save_strategy(s, directory / rank_name(rank, ext))


def ms_messages(path):
    from mindspore.parallel import build_searched_strategy

    return {k: v.SerializeToString() for k, v in build_searched_strategy(str(path)).items()}


def ms_view(path):
    """MindSpore's per-name view; stage lists sorted (their order follows the files' listing order)."""
    from mindspore.parallel import build_searched_strategy
    from mindspore.parallel._parallel_serialization import _convert_to_list

    return {k: v[:6] + [sorted(v[6])] for k, v in _convert_to_list(build_searched_strategy(str(path))).items()}


def placement(s: Strategy):
    return {(e.stage, e.name, e.layout) for e in s.entries}


# --- agreement with MindSpore ----------------------------------------------------------------


@pytest.mark.parametrize("ext", ["ckpt", "json"])
@pytest.mark.parametrize("dp,tp,pp", [(1, 2, 2), (2, 2, 2), (1, 2, 3)])
def test_merge_equals_merge_pipeline_strategys(ms, tmp_path, dp, tp, pp, ext):
    from mindspore.parallel._parallel_serialization import _extract_pipeline_stage_num

    src = tmp_path / "strategy"
    write_job(src, job(dp, tp, pp), ext)
    ms_path = tmp_path / "merged" / f"merged_ckpt_strategy.{ext}"
    ms.parallel.merge_pipeline_strategys(str(src), str(ms_path))
    theirs = load_strategy(ms_path)

    ours = merge_rank_strategies(load_rank_strategies(src), where=str(src))
    assert ours.merged and theirs.merged
    assert placement(ours) == placement(theirs)
    assert ours.content_hash() == theirs.content_hash()
    assert (ours.stages, ours.stage_device_num, ours.world_size) == (pp, dp * tp, pp * dp * tp)
    assert (theirs.stages, theirs.stage_device_num, theirs.world_size) == (pp, dp * tp, pp * dp * tp)
    assert sorted(ours.op_items, key=repr) == sorted(theirs.op_items, key=repr)
    assert ours.current_stage == theirs.current_stage == 1 and ours.format == theirs.format
    assert ours.source_path == str(src)
    # the tied embedding: one entry per stage holding it, its lowest stage's layout answers by name
    assert [e.stage for e in ours.entries if e.name == "embed"] == sorted({0, pp - 1})
    assert ours.param("embed").stage == 0

    # MindSpore reads our merged file as it reads its own
    out = tmp_path / f"ours.{ext}"
    save_strategy(ours, out)
    assert ms_messages(out) == ms_messages(ms_path)
    assert ms_view(out) == ms_view(ms_path)
    assert _extract_pipeline_stage_num(str(out)) == pp
    for rank in range(ours.world_size):  # the identity transform: which source ranks a rank reads
        assert (ms.parallel.rank_list_for_transform(rank, str(out), str(out))
                == ms.parallel.rank_list_for_transform(rank, str(ms_path), str(ms_path)))
    assert load_strategy(out).content_hash() == ours.content_hash()
    # the bytes the catalog keeps for a merge are the file's
    data = encode_strategy(ours, "json" if ext == "json" else "proto")
    assert data == out.read_bytes() and placement(parse_strategy_bytes(data)) == placement(ours)


def test_single_stage_is_the_common_file(ms, tmp_path):
    per_rank = job(2, 2, 1)  # tp2 x dp2: four identical files
    src = tmp_path / "strategy"
    write_job(src, per_rank)
    assert len({(src / rank_name(r)).read_bytes() for r in range(4)}) == 1
    ours = merge_rank_strategies(load_rank_strategies(src))
    assert not ours.merged and (ours.stages, ours.stage_device_num, ours.world_size) == (1, 4, 4)
    for s in per_rank.values():
        assert placement(ours) == placement(s) and ours.content_hash() == s.content_hash()
    # MindSpore's merge of one stage: a merged file of stage 0 only, the same placement
    ms.parallel.merge_pipeline_strategys(str(src), str(tmp_path / "m.ckpt"))
    theirs = load_strategy(tmp_path / "m.ckpt")
    assert theirs.merged and placement(theirs) == placement(ours) and theirs.content_hash() == ours.content_hash()


def test_mindspore_merges_disagreeing_files_silently(ms, tmp_path):
    """Why we compare every file: MindSpore keeps the first file of a stage in listing order."""
    per_rank = job(1, 2, 2)
    per_rank[1] = stage_strategy(0, 1, 2, 2, **{"layers.0.wq": TensorLayout((1, 2), (0, -1))})
    src = tmp_path / "strategy"
    write_job(src, per_rank)
    ms.parallel.merge_pipeline_strategys(str(src), str(tmp_path / "m.ckpt"))  # no complaint
    kept = load_strategy(tmp_path / "m.ckpt").param("layers.0.wq").layout
    assert kept in (per_rank[0].param("layers.0.wq").layout, per_rank[1].param("layers.0.wq").layout)
    with pytest.raises(StrategyError, match=r"stage 0: rank 1 .* rank 0 .* disagree on 'layers.0.wq'"):
        merge_rank_strategies(load_rank_strategies(src))


# --- every problem, named --------------------------------------------------------------------


def _drop(*ranks):
    def edit(p):
        for r in ranks:
            del p[r]
    return edit


def _put(rank, stage, **overrides):
    def edit(p):
        p[rank] = stage_strategy(stage, 1, 2, 2, path=f"/run/strategy/{rank_name(rank)}", **overrides)
    return edit


def _put_wide(rank, stage):  # a file of a dp2 x tp2 layout: 4 devices per stage instead of 2
    def edit(p):
        p[rank] = stage_strategy(stage, 2, 2, 2, path=f"/run/strategy/{rank_name(rank)}")
    return edit


ERRORS = [
    ("missing rank", _drop(3), [r"rank 3 has no strategy file \(2 stages x 2 devices = ranks 0-3\)"]),
    ("missing ranks", _drop(1, 3), [r"ranks 1, 3 have no strategy file"]),
    ("wrong stage", _put(2, 0), [r"rank 2: ckpt_strategy_rank_2.ckpt holds stage 0, but with 2 devices per stage "
                                 r"rank 2 belongs to stage 1"]),
    ("beyond the world", _put(5, 1), [r"rank 5: .* holds stage 1, .* rank 5 belongs to stage 2"]),
    ("other layout", _put(1, 0, **{"layers.0.wq": TensorLayout((1, 2), (0, -1))}),
     [r"stage 0: rank 1 \(ckpt_strategy_rank_1.ckpt\) and rank 0 \(ckpt_strategy_rank_0.ckpt\) disagree on "
      r"'layers.0.wq': dev_matrix \[1, 2\] tensor_map \[0, -1\] vs dev_matrix \[1, 2\] tensor_map \[-1, 0\]"]),
    ("a parameter less", _put(3, 1, head=None), [r"stage 1: rank 3 .* and rank 2 .* disagree on 'head': absent vs"]),
    ("stage missing", lambda p: (_drop(0, 1)(p)), [r"no file holds pipeline stage 0 \(ranks 0-1\)"]),
    ("a file of another layout", _put_wide(2, 1), [r"stage 1: rank 3 .* rank 2 .* disagree on 'embed': dev_matrix "
                                                   r"\[1, 2\] .* vs dev_matrix \[2, 2\]"]),
    ("devices differ per stage", lambda p: (_put_wide(2, 1)(p), _put_wide(3, 1)(p)),
     [r"^stages span different numbers of devices: stage 0: 2 \(ranks 0-1\), stage 1: 4 \(ranks 2-3\); ranks are "
      r"not checked"]),
    ("several at once", lambda p: (_drop(3)(p), _put(1, 0, **{"layers.0.norm": TensorLayout((1, 2), (0,))})(p)),
     [r"^2 problems: \(1\) stage 0: rank 1 .* 'layers.0.norm'", r"\(2\) rank 3 has no strategy file"]),
    ("merged file", lambda p: p.__setitem__(0, merge_rank_strategies(job(1, 2, 2))), [r"rank 0: .* already a merged"]),
    ("no layouts", lambda p: p.__setitem__(1, Strategy.build([], source_path="/run/strategy/x_rank_1.ckpt")),
     [r"rank 1: x_rank_1.ckpt holds no parameter layouts"]),
    ("bad rank", lambda p: p.__setitem__(-1, p[0]), [r"-1 is not a global rank"]),
    ("nothing", lambda p: p.clear(), [r"no per-rank strategy files"]),
]


@pytest.mark.parametrize("edit,patterns", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_name_the_ranks(edit, patterns):
    per_rank = job(1, 2, 2)  # tp2 x pp2: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3
    edit(per_rank)
    with pytest.raises(StrategyError) as info:
        merge_rank_strategies(per_rank, where="/run/strategy")
    err = info.value
    for pattern in patterns:
        assert re.search(pattern, err.message), (pattern, err.message)
    assert err.path == "/run/strategy" and err.hint
    assert str(err).startswith("/run/strategy: ")


def test_a_missing_last_stage_needs_the_world_size():
    per_rank = job(1, 2, 2)
    del per_rank[2], per_rank[3]
    alone = merge_rank_strategies(per_rank)  # nothing in stage 0's files says a stage 1 exists
    assert not alone.merged and alone.world_size == 2
    with pytest.raises(StrategyError, match=r"no file holds pipeline stage 1 \(ranks 2-3\)"):
        merge_rank_strategies(per_rank, world_size=4)
    assert merge_rank_strategies(job(1, 2, 2), world_size=4).world_size == 4
    for world, match in [(3, "not a positive multiple"), (2, "more than the job's 2"), (0, "positive multiple")]:
        with pytest.raises(StrategyError, match=match):
            merge_rank_strategies(job(1, 2, 2), world_size=world)


def test_where_defaults_to_the_files_directory():
    per_rank = job(1, 2, 2, "/a/strategy")
    del per_rank[0]
    with pytest.raises(StrategyError) as info:
        merge_rank_strategies(per_rank)
    assert info.value.path == "/a/strategy" and "rank 0 has no strategy file" in info.value.message


def test_stage_missing_in_the_middle_and_every_rank_reported_once():
    per_rank = job(1, 2, 3)
    del per_rank[2], per_rank[3], per_rank[5]  # stage 1 gone, and rank 5 of stage 2
    with pytest.raises(StrategyError) as info:
        merge_rank_strategies(per_rank)
    msg = info.value.message
    assert "no file holds pipeline stage 1 (ranks 2-3)" in msg and "rank 5 has no strategy file" in msg
    assert "ranks 2" not in msg.split("(ranks 2-3)")[1]  # the missing stage's ranks are not listed twice


def test_agreeing_files_may_differ_in_operator_items():
    per_rank = job(1, 2, 2)
    s = per_rank[1]
    per_rank[1] = Strategy.build(s.entries, op_items=[OpItem("Default/other-op9", 0, ())], source_path=s.source_path)
    merged = merge_rank_strategies(per_rank)
    assert merged.op_items[0] == per_rank[0].op_items[0]  # the lowest rank's file speaks for its stage


def test_reference_is_the_majority():
    per_rank = job(4, 1, 1)  # one stage, four ranks; rank 0's file is the stale one
    stale = {"layers.0.norm": TensorLayout((4, 1), (0,))}
    per_rank[0] = stage_strategy(0, 4, 1, 1, path=per_rank[0].source_path, **stale)
    with pytest.raises(StrategyError, match=r"stage 0: rank 0 .* and rank 1 .* disagree on 'layers.0.norm'") as info:
        merge_rank_strategies(per_rank)
    assert info.value.message.count("disagree") == 1


def test_rank_ranges_stay_short():
    per_rank = job(1, 64, 2)
    for r in [*range(3, 40), 70, 100, 101]:
        del per_rank[r]
    with pytest.raises(StrategyError, match=r"ranks 3-39, 70, 100-101 have no strategy file"):
        merge_rank_strategies(per_rank)


# --- loading a directory ---------------------------------------------------------------------


def test_load_rank_strategies_names_and_extras(tmp_path):
    src = tmp_path / "strategy"
    write_job(src, job(1, 2, 2))
    save_strategy(merge_rank_strategies(load_rank_strategies(src)), src / "merged_ckpt_strategy.ckpt")
    save_strategy(merge_rank_strategies(load_rank_strategies(src)), src / "merged_ckpt_strategy_rank_0.ckpt")
    (src / "merge_succeed.txt").write_text("ok")
    (src / "ckpt_strategy.ckpt").write_bytes(b"not per-rank")
    (src / "ckpt_strategy_rank_9.ckpt.tmp").write_bytes(b"in flight")
    shutil.move(src / rank_name(3), src / "a_rank_7_rank_3.json.ckpt.x")  # not a strategy name: rank 3 missing
    save_strategy(stage_strategy(1, 1, 2, 2), src / "a_rank_7_rank_3.json")  # the last _rank_<r> is the tag
    got = load_rank_strategies(src)
    assert sorted(got) == [0, 1, 2, 3]
    assert got[3].source_path == str(src / "a_rank_7_rank_3.json") and got[3].format == "json"
    assert merge_rank_strategies(got).world_size == 4


def test_load_refuses_links_fifos_and_damage_in_one_error(tmp_path):
    src = tmp_path / "strategy"
    write_job(src, job(1, 2, 2))
    os.replace(src / rank_name(1), tmp_path / "elsewhere.ckpt")
    os.symlink(tmp_path / "elsewhere.ckpt", src / rank_name(1))
    os.unlink(src / rank_name(2))
    os.mkfifo(src / rank_name(2))
    (src / rank_name(3)).write_bytes(b"\x0f garbage")
    (src / rank_name(4)).mkdir()
    save_strategy(stage_strategy(0, 1, 2, 2), src / "b_rank_0.json")  # a second file for rank 0

    result: list[BaseException] = []
    t = threading.Thread(target=lambda: result.append(pytest.raises(StrategyError, load_rank_strategies, src).value))
    t.start()
    t.join(timeout=20)
    if t.is_alive():  # unblock the reader before failing, so the test run does not hang
        with open(src / rank_name(2), "wb"):
            pass
        pytest.fail("load_rank_strategies blocked on a FIFO")
    err = result[0]
    msg = err.message
    assert msg.startswith("5 problems") and err.path == str(src)
    assert "rank 0 has several strategy files: b_rank_0.json, ckpt_strategy_rank_0.ckpt" in msg
    for rank in (1, 2, 4):
        assert f"{rank_name(rank)}: not a regular file" in msg
    assert f"{rank_name(3)}: " in msg and "@ byte" in msg
    assert "does not follow links" in err.hint


def test_load_bounds_the_read(tmp_path, monkeypatch):
    src = tmp_path / "strategy"
    write_job(src, job(1, 2, 1))
    monkeypatch.setattr(strategy_merge, "MAX_STRATEGY_BYTES", 16)
    with pytest.raises(StrategyError, match=r"too large for a strategy file"):
        load_rank_strategies(src)


def test_load_missing_directory(tmp_path):
    with pytest.raises(StrategyError, match="cannot list") as info:
        load_rank_strategies(tmp_path / "nope")
    assert info.value.path == str(tmp_path / "nope")
    assert load_rank_strategies(tmp_path) == {}
