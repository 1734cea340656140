"""Table tests: which paths under a checkpoint root are shards, strategies, or nothing."""

from __future__ import annotations

import os

import pytest

from ckptd.runlayout import MINDFORMERS, ShardName, StrategyName, classify, resolves_inside

ROOT = "/ckpt"


@pytest.mark.parametrize(
    "rel, want",
    [
        ("llama/rank_0/llama-1_100.ckpt", ShardName("llama", 0, "llama", 1, 100, False, "ckpt", incarnation=0)),
        ("llama/rank_12/llama_1-3_4200.ckpt", ShardName("llama", 12, "llama_1", 3, 4200, False, "ckpt", incarnation=1)),
        ("llama/rank_3/net-2_50_breakpoint.ckpt", ShardName("llama", 3, "net", 2, 50, True, "ckpt")),
        ("llama/rank_0/llama-1_100.safetensors",
         ShardName("llama", 0, "llama", 1, 100, False, "safetensors", incarnation=0)),
        ("a-b/rank_0/my-model-1_7.ckpt", ShardName("a-b", 0, "my-model", 1, 7, False, "ckpt", incarnation=0)),
        ("llama/rank_0/llama-1_100.tmp", None),  # MindSpore's in-flight file
        ("llama/rank_0/llama-1_100.ckpt.ckptd-tmp", None),
        ("llama/rank_0/llama-1_100.ckpt.done", None),  # sidecar: handled separately
        ("llama/rank_0/notes.txt", None),
        ("llama/rank_x/llama-1_100.ckpt", None),
        ("llama/llama-1_100.ckpt", None),
        ("llama/rank_0/sub/llama-1_100.ckpt", None),
        ("llama/rank_0/.hidden-1_100.ckpt", None),
        (".trash/rank_0/llama-1_100.ckpt", None),
        ("llama/strategy.ckpt", StrategyName("llama")),
        ("llama/src_strategy.json", StrategyName("llama")),
        ("llama/strategy/stage0.ckpt", StrategyName("llama")),
        ("llama/other.ckpt", None),
        ("../etc/rank_0/x-1_1.ckpt", None),
    ],
)
def test_classify(rel, want):
    assert classify(ROOT, os.path.normpath(os.path.join(ROOT, rel))) == want


@pytest.mark.parametrize(
    "rel, want",
    [
        # a restart's files: the _k after the rank tag is the incarnation
        ("toy/checkpoint/rank_0/toy_rank_0-2_6.ckpt", ShardName("toy", 0, "toy", 2, 6, False, "ckpt", MINDFORMERS, 0)),
        ("toy/checkpoint/rank_0/toy_rank_0_1-1_3.ckpt",
         ShardName("toy", 0, "toy_1", 1, 3, False, "ckpt", MINDFORMERS, 1)),
        # exception_save: prefix without the restart suffix, so no incarnation can be read off the name ...
        ("toy/checkpoint/rank_0/toy_rank_0-1_4_breakpoint.ckpt",
         ShardName("toy", 0, "toy", 1, 4, True, "ckpt", MINDFORMERS, None)),
        # ... and its _1 is MindSpore's same-name counter over earlier breakpoints, not incarnation 1
        ("toy/checkpoint/rank_0/toy_rank_0_1-1_4_breakpoint.ckpt",
         ShardName("toy", 0, "toy_1", 1, 4, True, "ckpt", MINDFORMERS, None)),
        ("toy/rank_2/toy_rank_2_3-1_4_breakpoint.ckpt", ShardName("toy", 2, "toy_3", 1, 4, True, "ckpt", "native", None)),
        # plain MindSpore (no rank tag): ModelCheckpoint's _k after the prefix, 0 for the first
        ("run/rank_0/net-1_5.ckpt", ShardName("run", 0, "net", 1, 5, False, "ckpt", "native", 0)),
        ("run/rank_0/net_1-1_5.ckpt", ShardName("run", 0, "net_1", 1, 5, False, "ckpt", "native", 1)),
        ("run/rank_0/net_2-1_5.ckpt", ShardName("run", 0, "net_2", 1, 5, False, "ckpt", "native", 2)),
        # a user prefix that does not end in _<k> is no restart
        ("run/rank_0/llama_7b-1_5.ckpt", ShardName("run", 0, "llama_7b", 1, 5, False, "ckpt", "native", 0)),
        ("run/rank_0/net_007-1_5.ckpt", ShardName("run", 0, "net_007", 1, 5, False, "ckpt", "native", 0)),
        # one that does: the prefix (the step's identity) is kept whole; the suffixes add up, so the
        # restart resnet_50_1 comes after resnet_50 whichever was the user's prefix
        ("run/rank_0/resnet_50-1_5.ckpt", ShardName("run", 0, "resnet_50", 1, 5, False, "ckpt", "native", 50)),
        ("run/rank_0/resnet_50_1-1_5.ckpt", ShardName("run", 0, "resnet_50_1", 1, 5, False, "ckpt", "native", 51)),
        # beyond any restart count: part of the user's prefix (a date, a job id)
        ("run/rank_0/exp_20240101-1_5.ckpt", ShardName("run", 0, "exp_20240101", 1, 5, False, "ckpt", "native", 0)),
        ("run/rank_0/exp_20240101_1-1_5.ckpt", ShardName("run", 0, "exp_20240101_1", 1, 5, False, "ckpt", "native", 1)),
        # another rank's tag: misplaced, kept apart by its whole prefix, no incarnation read
        ("run/rank_0/toy_rank_3-1_5.ckpt", ShardName("run", 0, "toy_rank_3", 1, 5, False, "ckpt", "native", None)),
    ],
)
def test_classify_incarnation(rel, want):
    assert classify(ROOT, os.path.normpath(os.path.join(ROOT, rel))) == want


def test_symlinks_resolving_outside_the_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "run").mkdir(parents=True)
    outside.mkdir()
    (outside / "f.ckpt").write_bytes(b"x")
    os.symlink(outside, root / "run" / "rank_0")
    assert not resolves_inside(str(root), str(root / "run" / "rank_0" / "f.ckpt"))
    (root / "run" / "rank_1").mkdir()
    assert resolves_inside(str(root), str(root / "run" / "rank_1" / "f.ckpt"))
