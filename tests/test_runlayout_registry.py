"""Layouts as objects (issue 21, item 3): one row per layout says what a run of it looks like on
disk, what its paths are, and what it answers. Each row is checked on a real directory tree, so a
new layout is a module of ckptd/runlayout/, its registry entry and a row here."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from ckptd import runlayout
from ckptd.runlayout import HealthName, MetaName, ShardName, StrategyName, TrackerName


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    files: tuple[str, ...]  # below the run directory: what a save of this layout leaves
    #: below the run directory -> (type of what classify says, its rank/slot, step) or None
    #: (classification is by the path's shape alone, whatever the run's layout)
    paths: dict[str, tuple[type, int | None, int | None] | None]
    shard_dirs: tuple[str, ...]  # what a rescan lists, in order, relative to the run directory
    step_dirs: tuple[str, ...]  # directories removed with their step
    capabilities: dict[str, bool]
    rank0_dir: str | None  # where rank 0 writes (None: no rank directories)
    prefix_of_rank_3: str | None  # file_prefix("net", 3, incarnation=2)


ROWS = [
    Row("native",
        ("rank_0/net-1_5.ckpt", "rank_1/net-1_5.ckpt", "strategy.ckpt"),
        {"rank_1/net-1_5.ckpt": (ShardName, 1, 5), "rank_0/net-1_5_breakpoint.ckpt": (ShardName, 0, 5),
         "strategy.ckpt": (StrategyName, None, None), "rank_0/notes.txt": None, "rank_0/net-1_5.ckpt.tmp": None,
         "rank_0/.net-1_5.ckpt": None},
        ("rank_0", "rank_1"), (),
        dict(fallback=True, allows_subset=False, iterations=False, health_records=False, mindformers_resume=False,
             has_tracker=False),
        "rank_0", "net"),
    Row("mindformers",
        ("checkpoint/rank_0/net_rank_0-1_5.ckpt", "checkpoint/rank_0/meta.json", "strategy/ckpt_strategy_rank_0.ckpt",
         "health_ckpts.json"),
        {"checkpoint/rank_0/net_rank_0-1_5.ckpt": (ShardName, 0, 5), "checkpoint/rank_2/meta.json": (MetaName, 2, None),
         "health_ckpts.json": (HealthName, None, None), "strategy/ckpt_strategy_rank_1.ckpt": (StrategyName, 1, None),
         "checkpoint/rank_0/other.json": None},
        ("checkpoint/rank_0",), (),
        dict(fallback=False, allows_subset=True, iterations=False, health_records=True, mindformers_resume=True,
             has_tracker=False),
        "checkpoint/rank_0", "net_rank_3_2"),
    Row("mindformers2",
        ("checkpoint/iteration_00000006/common.json", "checkpoint/iteration_00000006/net-model-0000000-0000001.safetensors",
         "checkpoint/iteration_00000002/common.json", "checkpoint/latest_checkpointed_iteration.txt"),
        {"checkpoint/iteration_00000006/common.json": (ShardName, 1, 6),
         "checkpoint/iteration_00000006/metadata.json": (ShardName, 0, 6),
         "checkpoint/iteration_00000006/net-opt-0000001-0000002.safetensors": (ShardName, 5, 6),
         "checkpoint/latest_checkpointed_iteration.txt": (TrackerName, None, None),
         "checkpoint/iteration_00000006/other.json": None},
        ("checkpoint/iteration_00000002", "checkpoint/iteration_00000006"),
        ("checkpoint/iteration_00000002", "checkpoint/iteration_00000006"),
        dict(fallback=False, allows_subset=False, iterations=True, health_records=False, mindformers_resume=False,
             has_tracker=True),
        None, "net"),
]


def _tree(run: Path, files: tuple[str, ...]) -> None:
    for rel in files:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text("x")


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_each_layout_on_a_real_tree(tmp_path, row):
    run = tmp_path / "job"
    _tree(run, row.files)
    layout = runlayout.detect(str(run))
    assert layout is runlayout.by_name(row.name) and layout.name == row.name
    assert runlayout.detect_layout(str(run)) == row.name
    for rel, want in row.paths.items():
        got = runlayout.classify(str(tmp_path), str(run / rel))
        if want is None:
            assert got is None, rel
            continue
        kind, number, step = want
        assert type(got) is kind, (rel, got)
        assert getattr(got, "rank", None) == number and getattr(got, "step", None) == step, (rel, got)
        if isinstance(got, ShardName):
            assert got.layout == row.name and got.run == "job"
    listed = runlayout.shard_dirs(str(run))
    assert listed.layout is layout
    assert sorted(os.path.relpath(d, run) for d in listed.shard_dirs) == sorted(row.shard_dirs)
    if layout.iterations:
        assert [os.path.relpath(d, run) for d in listed.shard_dirs] == list(row.shard_dirs)  # by iteration
    for rel in row.shard_dirs:
        assert runlayout.is_step_dir(str(tmp_path), str(run / rel)) == (rel in row.step_dirs)
    assert {k: getattr(layout, k) for k in row.capabilities} == row.capabilities
    assert layout.allows_subset == runlayout.by_name(row.name).allows_subset
    from ckptd.states import allows_subset

    assert allows_subset(row.name) == row.capabilities["allows_subset"]
    if row.rank0_dir is None:
        assert layout.rank_base(str(run)) is None and layout.rank_dirs(str(run)) == {}
        with pytest.raises(ValueError):
            layout.shard_dir(str(run), 0)
    else:
        assert layout.shard_dir(str(run), 0) == str(run / row.rank0_dir)
        assert runlayout.shard_dir(str(run), 0, row.name) == str(run / row.rank0_dir)
        assert layout.rank_dirs(str(run)) == runlayout.rank_dirs(str(run)) and 0 in layout.rank_dirs(str(run))
    assert layout.file_prefix("net", 3, 2) == row.prefix_of_rank_3


def test_detection_order_and_the_fallback(tmp_path):
    """MindFormers legacy wins over Checkpoint 2.0 in one run; native is whatever is left, even an
    empty or missing directory; symlinked rank directories do not make a run MindFormers'."""
    both = tmp_path / "both"
    _tree(both, ("checkpoint/rank_0/x_rank_0-1_1.ckpt", "checkpoint/iteration_00000001/common.json"))
    assert runlayout.detect(str(both)).name == runlayout.MINDFORMERS
    (tmp_path / "empty").mkdir()
    assert runlayout.detect(str(tmp_path / "empty")) is runlayout.by_name(None)
    assert runlayout.detect(str(tmp_path / "missing")).name == runlayout.NATIVE
    linked = tmp_path / "linked"
    (linked / "checkpoint").mkdir(parents=True)
    os.symlink(tmp_path / "both" / "checkpoint" / "rank_0", linked / "checkpoint" / "rank_0")
    assert runlayout.detect(str(linked)).name == runlayout.NATIVE
    assert [layout.name for layout in runlayout.LAYOUTS] == [runlayout.MINDFORMERS, runlayout.CKPT2, runlayout.NATIVE]


def test_the_registry_maps_catalog_values_back():
    for layout in runlayout.LAYOUTS:
        assert runlayout.by_name(layout.name) is layout and runlayout.known(layout.name)
    assert runlayout.by_name(None).fallback
    assert not runlayout.known("mindformers3") and not runlayout.known(None)
    with pytest.raises(ValueError, match="unknown run layout"):
        runlayout.by_name("mindformers3")
    # native gives way to any layout found later; no other layout ever does
    assert runlayout.run_layout_after(None, runlayout.NATIVE) == runlayout.NATIVE
    assert runlayout.run_layout_after(runlayout.NATIVE, runlayout.MINDFORMERS) == runlayout.MINDFORMERS
    assert runlayout.run_layout_after(runlayout.MINDFORMERS, runlayout.NATIVE) == runlayout.MINDFORMERS


def test_layouts_are_immutable_and_hashable():
    layout = runlayout.by_name(runlayout.CKPT2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.iterations = False  # type: ignore[misc]
    assert len({*runlayout.LAYOUTS, *runlayout.LAYOUTS}) == 3
    assert not hasattr(layout, "__dict__")


def test_whole_step_dir_is_the_iteration_rule():
    ckpt2 = runlayout.by_name(runlayout.CKPT2)
    names = ["common.json", "net-model-0000000-0000002.safetensors", "net-model-0000001-0000002.safetensors"]
    files = [runlayout.parse_iteration_file("j", 6, n) for n in names]
    assert ckpt2.whole_step_dir(files)  # type: ignore[arg-type]
    assert not ckpt2.whole_step_dir(files[:2])  # type: ignore[arg-type]  # a model file missing
    assert not ckpt2.whole_step_dir(files[1:])  # type: ignore[arg-type]  # no common.json
    assert not runlayout.by_name(runlayout.NATIVE).whole_step_dir(files)  # type: ignore[arg-type]


#: a comparison with a layout name or constant; ``Checkpoint.layout`` is a strategy hash (a step's
#: tp/dp/pp split), not a run's directory shape
_NAMED = re.compile(r'(?<!Checkpoint\.)layout(\([^)]*\)|"\)|"\])?\s*[!=]=\s*("|runlayout\.)|layout in \(|'
                    r'runlayout\.(NATIVE|MINDFORMERS|CKPT2)\b|or "native"')


def test_no_module_outside_runlayout_names_a_layout():
    """Layout names are the registry's: elsewhere a module asks the object (a name in a docstring,
    a help text or the ``mindformers`` key of a resume answer is not a comparison)."""
    ckptd_dir = Path(runlayout.__file__).resolve().parent.parent
    hits = [f"{path.relative_to(ckptd_dir)}:{n}: {line.strip()}"
            for path in sorted(ckptd_dir.rglob("*.py")) if path.parent.name not in ("runlayout", "versions")
            for n, line in enumerate(path.read_text().splitlines(), 1) if _NAMED.search(line)]
    assert not hits, hits
    for before in ('if run.layout == runlayout.CKPT2:', 'return run_layout == "mindformers"', 'doc.get("layout") != "x"',
                   'if _layout(s, ckpt) == runlayout.CKPT2:', 'run.layout in (None, runlayout.NATIVE)'):
        assert _NAMED.search(before), before
    assert not _NAMED.search('Checkpoint.layout == "",')
