"""MindFormers' legacy layout end to end in the daemon: catalog, verify, resume exactly what it writes.

Files are written by the real ``mindspore.save_checkpoint`` at MindFormers' names and directories
(tests/mf_fixtures.py), and by MindFormers' own code (tests/fixtures/mindformers/). Every case runs
on embedded SQLite and on the real PostgreSQL.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.orm import sessionmaker

from ckptd.catalog.db import make_engine
from ckptd.daemon import Daemon
from ckptd.format.strategy import save_strategy
from ckptd.service.resume import NoRestorableStepError, ResumeOptions, resume
from ckptd.storage import PosixStorage
from tests.daemon_helpers import catalog_snapshot, query, started_daemon, wait_for, wait_or_stop
from tests.mf_fixtures import RESUME_SCENARIOS, MFJob, tear, write_health

FIXTURES = Path(__file__).parent / "fixtures" / "mindformers"


def _states(url: str, run: str) -> dict[tuple[int, int, int | None], str]:
    """(epoch, step in the file name, incarnation) -> state of the run's trained steps."""
    rows = query(url, "SELECT c.epoch, c.step, c.incarnation, c.state FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                      "WHERE r.name = :run AND c.kind = 'trained'", run=run)
    return {(epoch, step, inc): state for epoch, step, inc, state in rows}


def _settle(root: Path, url: str, run: str, want: dict, timeout: float = 60) -> Daemon:
    d = started_daemon(root, url)

    def check():
        d.verifier.drain(timeout=10)
        got = _states(url, run)
        return got if got == want else None

    return wait_or_stop(d, check, timeout, f"states {want}")


def _resume(url: str, run: str, **opts) -> dict:
    engine = make_engine(url)
    try:
        with sessionmaker(engine).begin() as s:
            return resume(s, run, ResumeOptions(lease=False, **opts))
    finally:
        engine.dispose()


def test_tp2_pp2_newest_whole_step_torn_and_incomplete_skipped(ms, root, catalog_url):
    job = MFJob(root / "job", tp=2, dp=1, pp=2)
    job.strategy_files()
    for step in (10, 20, 30):
        job.save(step)
    tear(job.path(3, 30))  # a torn write that still carries its final name
    job.save(40, ranks=[0, 1, 2])  # the node holding rank 3 died mid-save
    job.write_meta(0, *job.epoch_step(40), job.file_name(0, 40))  # meta.json lies: it names the incomplete step
    job.network_copy(20)  # network-only copies are not training checkpoints
    d = _settle(root, catalog_url, "job", {(1, 10, 0): "verified", (1, 20, 0): "verified", (1, 30, 0): "corrupt",
                                            (1, 40, 0): "incomplete"})
    d.stop()
    assert query(catalog_url, "SELECT layout, world_size FROM runs") == [("mindformers", 4)]
    assert query(catalog_url, "SELECT count(*) FROM shards WHERE path LIKE '%checkpoint_network%'") == [(0,)]
    prefixes = {p for (p,) in query(catalog_url, "SELECT DISTINCT prefix FROM checkpoints")}
    assert prefixes == {"llama"}  # the rank tag never splits a step
    merged = query(catalog_url, "SELECT stages, world_size, error FROM strategy_files WHERE path = :p",
                   p=str(root / "job" / "strategy"))
    assert merged == [(2, 4, None)]  # the four stage files, merged (each is also recorded as the rank's file)
    assert len(query(catalog_url, "SELECT id FROM strategy_files WHERE path LIKE '%ckpt_strategy_rank_%'")) == 4
    bound = query(catalog_url, "SELECT DISTINCT s.path FROM checkpoints c JOIN strategy_files s ON s.id = c.strategy_id")
    assert bound == [(str(root / "job" / "strategy"),)]

    answer = _resume(catalog_url, "job")
    assert answer["step"] == 20 and answer["global_step"] == 20 and answer["layout"] == "mindformers"
    assert answer["strategy_file"] == str(root / "job" / "strategy")  # the per-rank files' directory
    assert [s["path"] for s in answer["shards"]] == [str(job.path(r, 20)) for r in range(4)]
    mf = answer["mindformers"]
    assert mf["load_checkpoint"] == str(root / "job" / "checkpoint")
    assert mf["resume_training"] == job.file_name(0, 20) and mf["loadable_by_mindformers"] is True
    skipped = {s["step"]: s["reason"] for s in answer["skipped"]}
    assert skipped[40].startswith("incomplete") and skipped[30].startswith("corrupt")
    assert "rank 3" in skipped[30]


def test_restart_incarnations_newest_complete_wins(ms, root, catalog_url):
    first = MFJob(root / "job", tp=2, dp=2, steps_per_epoch=8)
    first.strategy_files()
    first.save(4)
    first.save(12, ranks=[0, 2])  # crashed while saving global step 12 (epoch 2, step 4): tp index 1 never written
    second = MFJob(root / "job", tp=2, dp=2, steps_per_epoch=8, restart=1)  # resumed from step 4, same dir
    second.save(12)
    assert second.path(0, 12).name == "llama_rank_0_1-2_4.ckpt"
    d = _settle(root, catalog_url, "job", {(1, 4, 0): "verified", (2, 4, 0): "incomplete", (2, 4, 1): "verified"})
    d.stop()
    rows = query(catalog_url, "SELECT prefix, epoch, step, incarnation, global_step, state FROM checkpoints "
                              "ORDER BY epoch, incarnation")
    assert rows == [("llama", 1, 4, 0, 4, "verified"), ("llama", 2, 4, 0, None, "incomplete"),
                    ("llama_1", 2, 4, 1, 12, "verified")]
    answer = _resume(catalog_url, "job")
    assert (answer["global_step"], answer["incarnation"]) == (12, 1)
    assert answer["mindformers"]["resume_training"] == "llama_rank_0_1-2_4.ckpt"



def test_a_skipped_step_without_a_global_step_is_named_by_its_files(ms, root, catalog_url):
    """An incomplete save of global step 12 is named epoch 2 step 4 by MindFormers: until it
    verifies, its 'step' is the in-epoch 4, which a reader would take for global step 4."""
    job = MFJob(root / "job", tp=2, dp=2, steps_per_epoch=8)
    job.strategy_files()
    job.save(4)
    job.save(12, ranks=[0, 2])
    d = _settle(root, catalog_url, "job", {(1, 4, 0): "verified", (2, 4, 0): "incomplete"})
    d.stop()
    answer = _resume(catalog_url, "job")
    assert answer["global_step"] == 4
    (skip,) = answer["skipped"]
    assert skip["reason"].startswith("incomplete") and "files named epoch 2 step 4" in skip["reason"], skip


def test_dying_gasp_subset_that_covers_is_whole_and_one_that_does_not_is_incomplete(ms, root, catalog_url):
    job = MFJob(root / "job", tp=2, dp=2)
    job.strategy_files()
    job.save(10)
    job.save(20, ranks=[2, 3])  # MindIO TTP: only data-parallel replica 1 saved; it holds every slice
    job.save(30, ranks=[1, 3])  # both of tensor-parallel index 1: index 0's slices are nowhere
    d = _settle(root, catalog_url, "job", {(1, 10, 0): "verified", (1, 20, 0): "verified", (1, 30, 0): "incomplete"})
    d.stop()
    (reason,) = query(catalog_url, "SELECT reason FROM checkpoints WHERE step = 30")[0]
    assert "ranks [0, 2] have no file" in reason and "no file holds" in reason
    answer = _resume(catalog_url, "job")
    assert answer["step"] == 20
    by_rank = {s["rank"]: s for s in answer["shards"]}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert by_rank[0]["path"] == str(job.path(2, 20)) and by_rank[0]["own_file"] is False
    assert by_rank[1]["load_from"] == [str(job.path(3, 20))]
    assert by_rank[2]["own_file"] is True and by_rank[2]["path"] == str(job.path(2, 20))
    assert answer["mindformers"]["loadable_by_mindformers"] is False
    assert answer["mindformers"]["resume_training"] == job.file_name(2, 20)


def test_remove_redundancy_subsets_whole_when_their_union_is(ms, root, catalog_url):
    job = MFJob(root / "job", tp=2, dp=2, fmt="safetensors", remove_redundancy=True)
    job.strategy_files()
    job.save(10)
    job.save(20)
    # a rank whose share is unique to it: without its file the step cannot be whole
    lonely = next(r for r in range(job.world) if job.saved_params(r))
    os.chmod(job.path(lonely, 20), 0o600)
    os.remove(job.path(lonely, 20))
    d = _settle(root, catalog_url, "job", {(1, 10, 0): "verified", (1, 20, 0): "incomplete"})
    d.stop()
    answer = _resume(catalog_url, "job")
    assert answer["step"] == 10 and answer["mindformers"]["remove_redundancy"] is True
    for entry in answer["shards"]:
        assert entry["own_file"] is True and entry["path"] in entry["load_from"]
    # every rank loads from files that, together, hold every parameter of its stage
    from ckptd.format.checkpoint import open_checkpoint

    for entry in answer["shards"]:
        held: set[str] = set()
        for path in entry["load_from"]:
            with open_checkpoint(path) as ck:
                held |= set(ck.entries)
        assert set(job.expected_keys(entry["rank"])) <= held


def test_health_records_and_breakpoints(ms, root, catalog_url):
    job = MFJob(root / "job", tp=2, dp=1)
    job.strategy_files()
    for step in (10, 20):
        job.save(step)
    job.save(25, breakpoint=True)
    write_health(root / "job", [(job.file_name(0, 10), 0), (job.file_name(0, 20), 1)])  # 1 = ABNORMAL
    d = _settle(root, catalog_url, "job", {(1, 10, 0): "verified", (1, 20, 0): "verified"})
    d.stop()
    kinds = query(catalog_url, "SELECT kind, count(*) FROM checkpoints GROUP BY kind ORDER BY kind")
    assert kinds == [("breakpoint", 1), ("trained", 2)]
    answer = _resume(catalog_url, "job")
    assert answer["step"] == 10
    assert answer["skipped"][0]["step"] == 20 and "health_ckpts.json" in answer["skipped"][0]["reason"]


def test_strategy_files_missing_a_rank_or_disagreeing_are_specific_problems(ms, root, catalog_url):
    job = MFJob(root / "job", tp=2, dp=1, pp=2)
    files = job.strategy_files()
    os.remove(files[3])  # stage 1's second rank never wrote its strategy file
    job.save(10)
    d = started_daemon(root, catalog_url)
    try:
        merged_row = "SELECT error FROM strategy_files WHERE path = :p"
        where = str(root / "job" / "strategy")
        wait_for(lambda: query(catalog_url, merged_row, p=where), 30, what="strategy row")
        (error,) = query(catalog_url, merged_row, p=where)[0]
        assert "rank" in error and "3" in error
        # its files verify: restorable, and the reason says the layout was not checked (docs/ARCHITECTURE.md)
        wait_for(lambda: _states(catalog_url, "job").get((1, 10, 0)) == "verified", 30, what="step 10 verified")
        (reason,) = query(catalog_url, "SELECT reason FROM checkpoints")[0]
        assert reason.startswith("layout unchecked: ") and "strategy" in reason and "3" in reason
    finally:
        d.stop()


def test_strategy_files_that_describe_replicas_as_tensor_parallel_ranks_are_a_problem(ms, root, catalog_url):
    """tp2 x dp2 shards under per-rank tp4 strategy files: every shape is a possible tp4 slice (a
    strategy file has no full shapes), but ranks 0 and 2 hold the same bytes where tp4 would give
    them different slices. The step is corrupt with that reason, not answered for resume."""
    job = MFJob(root / "job", tp=2, dp=2)
    job.strategy_dir.mkdir(parents=True)
    lie = MFJob(root.parent / "other", tp=4, dp=1).strategy(0)
    for r in range(4):
        save_strategy(lie, job.strategy_dir / f"ckpt_strategy_rank_{r}.ckpt")
    job.save(10)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: _states(catalog_url, "job").get((1, 10, 0)) == "corrupt", 30, what="step 10 corrupt")
        (reason,) = query(catalog_url, "SELECT reason FROM checkpoints")[0]
        assert "holds the same bytes as rank 0" in reason and "different slices" in reason, reason
    finally:
        d.stop()
    honest = MFJob(root / "honest", tp=2, dp=2)
    honest.strategy_files()
    honest.save(10)
    d = _settle(root, catalog_url, "honest", {(1, 10, 0): "verified"})
    d.stop()


def test_mindformers_own_files_are_catalogued_and_resumed(ms, root, catalog_url):
    """Trees MindFormers' own CheckpointMonitor wrote (2.1.0 on CPU): names, restart, breakpoint."""
    shutil.copytree(FIXTURES / "legacy", root / "toy")
    d = _settle(root, catalog_url, "toy", {(2, 4, 0): "verified", (2, 6, 0): "verified", (1, 3, 1): "verified"})
    d.stop()
    rows = query(catalog_url, "SELECT prefix, epoch, step, incarnation, global_step, kind FROM checkpoints "
                              "ORDER BY kind, epoch, step")
    assert ("toy", 2, 6, 0, 12, "trained") in rows and ("toy_1", 1, 3, 1, 3, "trained") in rows
    assert any(kind == "breakpoint" for *_, kind in rows)
    answer = _resume(catalog_url, "toy")
    assert answer["global_step"] == 12 and answer["mindformers"]["resume_training"] == "toy_rank_0-2_6.ckpt"


# ckptd's answer on each tree MindFormers' own resume was run on (tests/mf_fixtures.RESUME_SCENARIOS,
# whose recorded MindFormers answers tests/test_mindformers_crosscheck.py checks live): the global step
# ckptd resumes, and whether MindFormers' loader can load it as is. Each tree gets the per-rank
# strategy files every semi-auto-parallel MindFormers job writes.
CKPTD_ANSWERS = {
    "complete": (200, True),
    "rank_missing_newest": (300, False),  # rank 2's slices are in its replica rank 0's file (MindFormers: 200)
    "meta_lags": (200, True),  # every rank wrote 200; a lagging meta.json says nothing (MindFormers: 100)
    "torn_newest": (100, True),  # rank 1's 200 is truncated (MindFormers: 200, which fails to load)
    "dying_gasp": (200, False),  # ranks 0,1 hold every slice (MindFormers: 100)
    "no_meta": (200, True),
    "corrupt_meta": (200, True),
    "restart_resumed": (300, False),  # further than the restart's 250 (MindFormers: 250, new prefix only)
    "restart_from_scratch": (300, True),  # (MindFormers: 50, the restart's meta.json won)
    "missing_top_rank_dir": (200, False),  # the strategy says 4 ranks; rank 3 loads rank 1's file
    "peer_writes": (200, True),
    "epochs": (150, True),
    "meta_lies": (100, False),  # (MindFormers raises)
    "resume_demo": (6, False),  # (MindFormers: 4)
    "pp_missing": (100, True),  # stage 1's rank 3 has no replica
}


@pytest.mark.parametrize("scenario", RESUME_SCENARIOS, ids=lambda s: s.name)
def test_ckptd_against_mindformers_own_resume_choice(ms, root, tmp_path, scenario):
    s = scenario
    assert set(CKPTD_ANSWERS) == {x.name for x in RESUME_SCENARIOS}
    job = s.build(root / "job")
    job.strategy_files()
    url = f"sqlite:///{tmp_path / 'c.db'}"
    from ckptd.catalog.db import upgrade

    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    want_step, want_loadable = CKPTD_ANSWERS[s.name]
    on_disk = sum(1 for p in (root / "job" / "checkpoint").rglob("*") if p.suffix in (".ckpt", ".safetensors"))
    d = started_daemon(root, url)
    try:
        def settled():
            """The answer, once every file is catalogued and verified and every step judged, all read in one
            snapshot of the catalog. (Separate reads once passed with the newest step registered just after
            the count of unverified shards was taken: the answer, read next, was the step before it.)"""
            d.verifier.drain(timeout=10)
            with catalog_snapshot(url) as s:
                catalogued, unverified = s.execute(text(
                    "SELECT count(*), count(*) FILTER (WHERE state = 'complete') FROM shards")).one()
                states = set(s.execute(text(
                    "SELECT c.state FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                    "WHERE r.name = 'job' AND c.kind = 'trained'")).scalars())
                unjudged = s.execute(text(  # its shards all verified, its step checks not run yet
                    "SELECT count(*) FROM checkpoints c WHERE c.kind = 'trained' AND c.step_checks_ok IS NULL "
                    "AND EXISTS (SELECT 1 FROM shards x WHERE x.checkpoint_id = c.id AND x.state = 'verified') "
                    "AND NOT EXISTS (SELECT 1 FROM shards x WHERE x.checkpoint_id = c.id "
                    "AND x.state NOT IN ('verified', 'superseded'))")).scalar_one()
                if catalogued != on_disk or unverified or unjudged or not states or "pending" in states:
                    return None
                try:
                    return resume(s, "job", ResumeOptions(lease=False))
                except NoRestorableStepError:
                    return None

        answer = wait_for(settled, 30, what="steps settled")
    finally:
        d.stop()
    assert (answer["global_step"], answer["mindformers"]["loadable_by_mindformers"]) == (want_step, want_loadable)
    assert {e["rank"] for e in answer["shards"]} == set(range(job.world))


def test_serve_answers_a_tp2_pp2_mindformers_run_and_picks_up_a_live_save(ms, root, tmp_path, catalog_url):
    """``ckptd serve`` as its own process over real HTTP: the newest whole step, torn and incomplete
    steps skipped with reasons, then a save written while it runs answered within seconds."""
    import time


    from tests.api_helpers import resume_of, serve_process

    job = MFJob(root / "job", tp=2, dp=1, pp=2)
    job.strategy_files()
    job.save(10), job.save(20), job.save(30)
    tear(job.path(2, 30))
    job.save(40, ranks=[0, 1, 3])
    log = tmp_path / "serve.log"
    proc, client = serve_process(root, catalog_url, log, "-v")  # events, not rescans, must find the live save
    try:
        def answer(step: int):
            body = resume_of(proc, client, log, "job")
            return body if body is not None and body["global_step"] == step else None

        def settled():  # step 20 answered once the torn and the incomplete step are judged too
            body = answer(20)
            judged = {s["step"] for s in (body or {}).get("skipped", []) if not s["reason"].startswith("pending")}
            return body if {30, 40} <= judged else None

        body = wait_for(settled, 60, interval=0.2, what="step 20 answered, 30 and 40 skipped")
        reasons = {s["step"]: s["reason"] for s in body["skipped"]}
        assert reasons[40].startswith("incomplete") and "rank 2" in reasons[30]
        assert body["mindformers"] == {"load_checkpoint": str(root / "job" / "checkpoint"),
                                       "resume_training": job.file_name(0, 20), "loadable_by_mindformers": True,
                                       "remove_redundancy": False}
        t0 = time.monotonic()
        job.save(50)
        try:
            wait_for(lambda: answer(50), 30, interval=0.1, what="the live save answered")
        except AssertionError as err:
            raw = client.get("/v1/runs/job/steps").text[:1500] + client.get("/v1/runs/job/steps/50/shards").text + client.get("/v1/runs/job/resume", params={"lease": "false"}).text
            raise AssertionError(f"{err}\ncatalog: {raw}\nserve log:\n{log.read_text()[-4000:]}") from None
        picked_up = time.monotonic() - t0
        assert picked_up < 30  # reported, not a performance bound: the rescan interval alone is 30 s
        print(f"live save of 4 ranks answered {picked_up:.2f} s after it was written")
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)


def test_gc_and_conversion_from_the_catalog_on_a_mindformers_run(ms, root, catalog_url):
    from ckptd.policy import RetentionPolicy
    from ckptd.service.conversions import convert_step
    from ckptd.service.retention import gc

    job = MFJob(root / "job", tp=2, dp=1, pp=2)
    job.strategy_files()
    for step in (10, 20, 30):
        job.save(step)
    d = _settle(root, catalog_url, "job", {(1, s, 0): "verified" for s in (10, 20, 30)})
    try:
        report = gc(d.sessions, PosixStorage(str(root)), RetentionPolicy(keep_last=2), run_name="job").to_dict()
        assert not any(job.path(r, 10).exists() for r in range(4))  # the oldest step's files, every rank
        assert all(job.path(r, 20).exists() and job.path(r, 30).exists() for r in range(4))
        assert [p for p in report["runs"] if p["run"] == "job"]
        assert (root / "job" / "strategy").is_dir() and job.meta_path(0).exists()  # only shards are ckptd's to delete
        from ckptd.format.strategy import save_strategy

        target = root / "job" / "targets" / "tp2.ckpt"  # one stage, tp=2: what the job would run on 2 ranks
        target.parent.mkdir()
        save_strategy(MFJob(root / "elsewhere", tp=2, dp=1, pp=1).strategy(0), target)
        convert_step(d.sessions, PosixStorage(str(root)), "job", 30, to_strategy=str(target))  # the merged stage files are the source
        answer = _resume(catalog_url, "job", world_size=2)
        existing = answer["conversion"]["existing"]
        assert answer["global_step"] == 30 and existing is not None and len(existing["shards"]) == 2
        import numpy as np

        from ckptd.format.checkpoint import open_checkpoint

        full = job.full_tensors(30)
        for name in ("model.tok_embeddings.embedding_weight", "model.layers.1.attention.wq.weight",
                     "lm_head.weight", "adam_m.model.layers.0.attention.wq.weight"):  # both stages, moments too
            parts = []
            for shard in sorted(existing["shards"], key=lambda x: x["rank"]):
                with open_checkpoint(shard["path"]) as ck:
                    parts.append(ck.array(name).copy())
            assert np.array_equal(np.concatenate(parts, axis=0), full[name]), name
    finally:
        d.stop()
