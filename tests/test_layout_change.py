"""A job restarted on another parallel layout re-saves steps the old layout had saved.

Real MindSpore saves, a real daemon, SQLite and PostgreSQL (``catalog_url``). The rule under test
is in ``ckptd.states``: a step re-saved under the strategy its strategy file holds now is re-bound
to it, the old layout's files that were not rewritten become ``superseded`` history (left on
disk), and the step is judged by the new layout alone. Steps the new job never saved keep the
layout they were saved with.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ckptd.daemon import Daemon
from ckptd.format.layout import TensorLayout
from ckptd.format.strategy import ParamStrategy, Strategy, load_strategy, save_strategy
from ckptd.policy import RetentionPolicy
from ckptd.service.resume import ResumeOptions, resume
from ckptd.service.retention import gc
from ckptd.settings import Settings
from ckptd.states import Resave, ShardState, StepState, layout_resave, step_state
from ckptd.storage import PosixStorage
from tests.daemon_helpers import FULL_W, query, rank_tensors, save_shard, step_states, wait_for, write_tp_strategy

RUN = "run1"


def _daemon(root: Path, url: str) -> Daemon:
    return Daemon(Settings(root=root, db=url, settle_seconds=0.2, rescan_interval=0.5, debounce=0.02))


@pytest.fixture
def daemon(root, catalog_url):
    d = _daemon(root, catalog_url)
    d.start()
    yield d
    d.stop()


def _settled(d: Daemon, url: str, want: dict[int, str], bound: dict[int, tuple[int, str]] | None = None,
             timeout: float = 30) -> None:
    """Wait for the step states (and, when the states alone cannot tell, the steps' bindings)."""
    def check():  # states reached with nothing left to examine or verify (not a transient on the way)
        d.verifier.drain(timeout=10)
        got = (step_states(url), _bindings(url) if bound is not None else None)
        quiet = d.watcher.idle() and query(url, "SELECT count(*) FROM shards WHERE state = 'complete'") == [(0,)]
        return got if got == (want, bound) and quiet else None

    wait_for(check, timeout, what=f"step states {want}, bindings {bound}")


def _strategy(root: Path, tp: int) -> str:
    """(Re)write the run's strategy file as a job on ``tp`` ranks does at start; its content hash."""
    path = root / RUN / "strategy.ckpt"
    if path.exists():
        path.unlink()
    return load_strategy(write_tp_strategy(root / RUN, tp=tp)).content_hash()


def _save(ms, root: Path, step: int, ranks, tp: int) -> None:
    for rank in ranks:
        save_shard(ms, root, RUN, rank, step, tensors=rank_tensors(rank, step, tp=tp))


def _column_split_strategy(root: Path) -> str:
    """Two ranks again, another layout: "w" split on dim 1 instead of dim 0."""
    path = root / RUN / "strategy.ckpt"
    path.unlink()
    entries = (ParamStrategy("w", TensorLayout(dev_matrix=(2,), tensor_map=(-1, 0))),
               ParamStrategy("b", TensorLayout(dev_matrix=(2,), tensor_map=(-1,))))
    save_strategy(Strategy.build(entries), path)
    return load_strategy(path).content_hash()


def _column_tensors(rank: int, step: int) -> dict[str, np.ndarray]:
    full = np.arange(np.prod(FULL_W), dtype=np.float32).reshape(FULL_W) + step
    cols = FULL_W[1] // 2
    w = np.ascontiguousarray(full[:, rank * cols : (rank + 1) * cols])
    return {"w": w, "b": np.full(3, float(step), np.float32)}


def _bindings(url: str) -> dict[int, tuple[int, str]]:
    """step -> (expected_ranks, strategy hash) of the run's trained steps."""
    rows = query(url, "SELECT c.step, c.expected_ranks, f.content_hash FROM checkpoints c "
                      "JOIN strategy_files f ON f.id = c.strategy_id WHERE c.kind = 'trained'")
    return {step: (n, h) for step, n, h in rows}


def _shards(url: str, step: int) -> dict[int, tuple[str, str]]:
    """rank -> (shard state, kind of the checkpoint row holding it) for one step."""
    rows = query(url, "SELECT s.rank, s.state, c.kind FROM shards s JOIN checkpoints c ON c.id = s.checkpoint_id "
                      "WHERE c.step = :step", step=step)
    return {rank: (state, kind) for rank, state, kind in rows}


def _resume(d: Daemon, **opts) -> dict:
    with d.sessions() as s:
        return resume(s, RUN, ResumeOptions(lease=False, **opts))


def _assert_4_to_2(url: str, root: Path, a: str, b: str) -> None:
    """Step 30 saved on 4 ranks under ``a``, re-saved on ranks 0/1 under ``b``; step 10 never re-saved."""
    assert _bindings(url) == {10: (4, a), 30: (2, b)}
    assert _shards(url, 30) == {0: ("verified", "trained"), 1: ("verified", "trained"),
                                2: ("superseded", "superseded"), 3: ("superseded", "superseded")}
    for rank in (2, 3):  # history, never deleted on verification
        assert (root / RUN / f"rank_{rank}" / "net-1_30.ckpt").exists()
    (history,) = query(url, "SELECT state, layout, expected_ranks, reason FROM checkpoints WHERE kind = 'superseded'")
    assert history[:3] == ("superseded", a, 4) and a in history[3] and b in history[3]
    errors = {e for (e,) in query(url, "SELECT error FROM shards WHERE state = 'superseded'")}
    assert errors == {f"saved under strategy {a}; step re-saved under {b}"}
    checked = query(url, "SELECT step_checks_ok, global_step, reason FROM checkpoints WHERE kind = 'trained' AND step = 30")
    assert checked == [(True, 30, None)]  # the checks ran again, under the new layout


# --- the pure rule --------------------------------------------------------------------------------

V, SUP, DEL = ShardState.VERIFIED, ShardState.SUPERSEDED, ShardState.DELETED


@pytest.mark.parametrize(
    "expected, shards, checks, want",
    [
        (2, {0: V, 1: V, 2: SUP, 3: SUP}, True, StepState.VERIFIED),  # superseded shards are not the step's
        (2, {0: V, 2: SUP, 3: SUP}, None, StepState.INCOMPLETE),  # they never count as present ranks
        (2, {0: V, 1: V, 2: SUP}, None, StepState.PENDING),
        (1, {0: V, 1: SUP}, True, StepState.VERIFIED),
        (2, {0: V, 1: DEL, 2: SUP}, True, StepState.DELETED),
    ],
)
def test_step_state_ignores_superseded_shards(expected, shards, checks, want):
    assert step_state(expected, shards, checks) == want


T = 1_000  # the new strategy file's mtime (ns) in the table below


@pytest.mark.parametrize(
    "bound, now, world, appeared, shards, want",
    [
        # 4 -> 2 ranks, ranks 0/1 rewritten after the new strategy appeared
        ("A", "B", 2, T, {"r0": (0, T + 5), "r1": (1, T + 9), "r2": (2, 10), "r3": (3, 11)},
         Resave(frozenset({"r0", "r1"}), frozenset({"r2", "r3"}))),
        # one rank rewritten so far (same world size): re-saved, the rest superseded until rewritten
        ("A", "B", 2, T, {"r0": (0, T), "r1": (1, T - 1)}, Resave(frozenset({"r0"}), frozenset({"r1"}))),
        # every shard older than the new strategy: not re-saved, keeps its layout
        ("A", "B", 2, T, {"r0": (0, T - 2), "r1": (1, T - 1)}, None),
        # a touched file of a rank outside the new world is never the new layout's
        ("A", "B", 2, T, {"r0": (0, 10), "r2": (2, T + 50)}, None),
        # 2 -> 4 ranks: new ranks and rewritten ones are kept
        ("A", "B", 4, T, {"r0": (0, T + 1), "r1": (1, 5), "r2": (2, T + 3)},
         Resave(frozenset({"r0", "r2"}), frozenset({"r1"}))),
        # bound to what the file holds now, or nothing known: nothing to do
        ("A", "A", 2, T, {"r0": (0, T + 1)}, None),
        (None, "B", 2, T, {"r0": (0, T + 1)}, None),
        ("A", None, 2, T, {"r0": (0, T + 1)}, None),
        ("A", "B", 2, None, {"r0": (0, T + 1)}, None),
        ("A", "B", 2, T, {}, None),
    ],
)
def test_layout_resave_table(bound, now, world, appeared, shards, want):
    assert layout_resave(bound, now, world, appeared, shards) == want


# --- the daemon -----------------------------------------------------------------------------------


def test_4_to_2_ranks_resave_supersedes_old_ranks_and_retention_takes_them_along(ms, root, catalog_url, daemon):
    a = _strategy(root, tp=4)
    _save(ms, root, 10, range(4), tp=4)
    _save(ms, root, 30, range(4), tp=4)
    _settled(daemon, catalog_url, {10: "verified", 30: "verified"})
    generation = "SELECT generation FROM resume_generations"
    (before,) = query(catalog_url, generation)[0]
    b = _strategy(root, tp=2)  # the job restarts on 2 ranks and resumes from step 25
    _save(ms, root, 30, range(2), tp=2)
    _settled(daemon, catalog_url, {10: "verified", 30: "verified"}, {10: (4, a), 30: (2, b)})
    _assert_4_to_2(catalog_url, root, a, b)
    assert query(catalog_url, generation)[0][0] > before  # cached resume answers are not served any more
    # each step answers with the layout it was saved with
    newest = _resume(daemon)
    assert (newest["step"], newest["world_size"], newest["strategy_hash"]) == (30, 2, b)
    assert [s["rank"] for s in newest["shards"]] == [0, 1]
    older = _resume(daemon, max_step=20)
    assert (older["step"], older["world_size"], older["strategy_hash"]) == (10, 4, a)
    # a leftover of a rank outside the new world touched (a backup restore, an operator): history it stays
    leftover = root / RUN / "rank_3" / "net-1_30.ckpt"
    os.utime(leftover, ns=(leftover.stat().st_atime_ns, leftover.stat().st_mtime_ns + 10**9))
    daemon.watcher.poke_rescan()
    assert daemon.wait_idle(30)
    _settled(daemon, catalog_url, {10: "verified", 30: "verified"}, {10: (4, a), 30: (2, b)})
    _assert_4_to_2(catalog_url, root, a, b)
    # the new job goes on; retention deletes the re-saved step together with its superseded files
    _save(ms, root, 40, range(2), tp=2)
    _settled(daemon, catalog_url, {10: "verified", 30: "verified", 40: "verified"})
    report = gc(daemon.sessions, PosixStorage(str(root)), RetentionPolicy(keep_last=1))
    assert report.deleted_steps == 3 and not report.refused  # steps 10 and 30, and step 30's history
    assert not any((root / RUN / f"rank_{r}" / "net-1_30.ckpt").exists() for r in range(4))
    assert query(catalog_url, "SELECT step, kind FROM checkpoints") == [(40, "trained")]
    _settled(daemon, catalog_url, {40: "verified"})


def test_same_world_size_layout_change_in_progress(ms, root, catalog_url, daemon):
    a = _strategy(root, tp=2)
    _save(ms, root, 10, range(2), tp=2)
    _save(ms, root, 30, range(2), tp=2)
    _settled(daemon, catalog_url, {10: "verified", 30: "verified"})
    b = _column_split_strategy(root)
    save_shard(ms, root, RUN, 0, 30, tensors=_column_tensors(0, 30))
    # rank 1 is still the old layout's
    _settled(daemon, catalog_url, {10: "verified", 30: "incomplete"}, {10: (2, a), 30: (2, b)})
    assert _shards(catalog_url, 30) == {0: ("verified", "trained"), 1: ("superseded", "superseded")}
    save_shard(ms, root, RUN, 1, 30, tensors=_column_tensors(1, 30))  # the superseded file is rewritten
    _settled(daemon, catalog_url, {10: "verified", 30: "verified"})
    assert _shards(catalog_url, 30) == {0: ("verified", "trained"), 1: ("verified", "trained")}
    assert query(catalog_url, "SELECT count(*) FROM checkpoints WHERE kind = 'superseded'") == [(0,)]  # history emptied
    outcomes = query(catalog_url, "SELECT e.outcome FROM verification_events e JOIN shards s ON s.id = e.shard_id "
                                  "WHERE s.rank = 1 AND e.kind = 'layout'")
    assert outcomes == [("superseded",)]  # the rank's story stays with it


def test_daemon_down_during_the_change_reaches_the_same_state(ms, root, catalog_url):
    a = _strategy(root, tp=4)
    _save(ms, root, 10, range(4), tp=4)
    _save(ms, root, 30, range(4), tp=4)
    d = _daemon(root, catalog_url)
    d.start()
    try:
        _settled(d, catalog_url, {10: "verified", 30: "verified"})
    finally:
        d.stop()
    b = _strategy(root, tp=2)  # nobody watching: only the rescan at the next start sees any of this
    _save(ms, root, 30, range(2), tp=2)
    d = _daemon(root, catalog_url)
    d.start()
    try:
        _settled(d, catalog_url, {10: "verified", 30: "verified"}, {10: (4, a), 30: (2, b)})
        # the strategy is examined first: step 30 is re-bound (and, from its old verdicts, verified)
        # before the rescan reaches the re-saved files; the answer is the state after the first rescan
        wait_for(lambda: d.watcher.ready.is_set() and _shards(catalog_url, 30)[0][0] == "verified"
                 and _shards(catalog_url, 30)[1][0] == "verified", 30, what="the re-saved shards verified")
        _assert_4_to_2(catalog_url, root, a, b)
    finally:
        d.stop()


def test_strategy_seen_after_the_resaved_shards(ms, root, catalog_url, daemon, tmp_path):
    """The new strategy file reaches the daemon late (renamed into place, keeping its mtime): the
    step first fails its checks under the old layout, then is re-bound when the strategy is seen."""
    a = _strategy(root, tp=4)
    _save(ms, root, 10, range(4), tp=4)
    _save(ms, root, 30, range(4), tp=4)
    _settled(daemon, catalog_url, {10: "verified", 30: "verified"})
    outside = tmp_path / "elsewhere"
    b = load_strategy(write_tp_strategy(outside, tp=2)).content_hash()  # written first, as a trainer does
    _save(ms, root, 30, range(2), tp=2)
    _settled(daemon, catalog_url, {10: "verified", 30: "corrupt"})  # ranks 0/1 of the new layout under the old
    os.replace(outside / "strategy.ckpt", root / RUN / "strategy.ckpt")
    _settled(daemon, catalog_url, {10: "verified", 30: "verified"}, {10: (4, a), 30: (2, b)})
    _assert_4_to_2(catalog_url, root, a, b)


def test_back_to_the_old_layout_makes_superseded_shards_the_steps_again(ms, root, catalog_url, daemon):
    a = _strategy(root, tp=4)
    _save(ms, root, 30, range(4), tp=4)
    _settled(daemon, catalog_url, {30: "verified"})
    b = _strategy(root, tp=2)
    _save(ms, root, 30, range(2), tp=2)
    _settled(daemon, catalog_url, {30: "verified"}, {30: (2, b)})
    assert _strategy(root, tp=4) == a  # the file goes back to content it had before
    _save(ms, root, 30, range(4), tp=4)
    _settled(daemon, catalog_url, {30: "verified"}, {30: (4, a)})
    assert _shards(catalog_url, 30) == {r: ("verified", "trained") for r in range(4)}
    assert query(catalog_url, "SELECT count(*) FROM checkpoints WHERE kind = 'superseded'") == [(0,)]
    assert len(list((root / RUN).glob("rank_*/net-1_30.ckpt"))) == 4  # nothing was deleted along the way
