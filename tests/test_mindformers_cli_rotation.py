"""A MindFormers-layout run through the operator's tools, and MindFormers' own checkpoint rotation.

* ``ckptd show`` / ``ckptd resume --run`` and ``GET /v1/runs/R/steps`` on a run whose file names
  count steps within the epoch: steps are shown and addressed by the global step, and the resume
  lines name what MindFormers' own loader takes.
* ``keep_checkpoint_max``: MindSpore's ``ModelCheckpoint`` deletes, per rank and before each save,
  the oldest files (by mtime) of the *current* prefix once ``keep_checkpoint_max`` are there. Ranks
  do it independently, so a slow rank leaves a step half rotated and the newest one half written;
  ckptd follows: the rotated step is deleted, the half-written one incomplete with a reason, the
  answer stays on the previous whole step and moves on when the slow rank finishes.

Files are written by the real ``mindspore.save_checkpoint`` (tests/mf_fixtures.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy.orm import sessionmaker

from ckptd.catalog.db import make_engine
from ckptd.service.resume import ResumeOptions, resume
from ckptd.settings import Settings
from tests.api_helpers import Server
from tests.daemon_helpers import migrated_sqlite, query, started_daemon, wait_for
from tests.mf_fixtures import MFJob, ckpt_name_re


def _ckptd(root: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], check=False, capture_output=True, text=True,
                          env=dict(os.environ, CKPTD_DB=url, CKPTD_ROOT=str(root)))


def test_show_resume_and_step_list_of_a_mindformers_run(ms, root, tmp_path):
    """Output formatting only, so one catalog backend (SQLite) is enough here."""
    url = migrated_sqlite(tmp_path / "catalog.db")
    job = MFJob(root / "job", tp=2, dp=1, pp=1, steps_per_epoch=4)
    job.strategy_files()
    job.save(4), job.save(6)  # global step 6 = epoch 2, step 2 in the file names
    with Server(Settings(root=root, db=url, settle_seconds=0.2)) as srv:
        srv.settle()
        with srv.client() as client:
            steps = client.get("/v1/runs/job/steps").json()
            detail = client.get("/v1/runs/job/steps/6").json()
    assert [(x["global_step"], x["epoch"], x["step"], x["state"]) for x in steps] == \
        [(6, 2, 2, "verified"), (4, 1, 4, "verified")]
    assert (detail["global_step"], detail["step"]) == (6, 2)  # the path takes the global step

    show = _ckptd(root, url, "show", "job", "6")
    assert show.returncode == 0, show.stderr
    assert show.stdout.splitlines()[0] == "run job step 6 (epoch 2, file-name step 2): verified"
    show4 = _ckptd(root, url, "show", "job", "4")  # global and file-name step agree: said once
    assert show4.stdout.splitlines()[0] == "run job step 4 (epoch 1): verified"

    r = _ckptd(root, url, "resume", "--run", "job", "--no-lease")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "resume run job at step 6 (epoch 2, 2 shards)"
    assert f"mindformers: load_checkpoint: {root / 'job' / 'checkpoint'}" in lines
    assert f"mindformers: resume_training: {job.file_name(0, 6)}" in lines  # llama_rank_0-2_2.ckpt
    assert not any("cannot load" in line for line in lines)  # every rank has its own file
    as_json = json.loads(_ckptd(root, url, "resume", "--run", "job", "--no-lease", "--json").stdout)
    assert as_json["mindformers"]["resume_training"] == "llama_rank_0-2_2.ckpt"


def _answer(url: str) -> dict:
    engine = make_engine(url)
    try:
        with sessionmaker(engine).begin() as s:
            return resume(s, "job", ResumeOptions(lease=False))
    finally:
        engine.dispose()


def _rotate(job: MFJob, rank: int, keep: int) -> list[str]:
    """MindSpore's ``CheckpointManager.remove_oldest_ckpoint_file`` before a save, as MindFormers
    configures it: the rank's files of the current prefix only (``_breakpoint`` and other restarts'
    files never), oldest mtime first, until one slot is free. Returns the removed names."""
    d, prefix = job.rank_dir(rank), job.rank_prefix(rank)
    pattern = ckpt_name_re(job.fmt)
    mine = sorted((p for p in d.iterdir() if pattern.match(p.name) and p.name.rsplit("-", 1)[0] == prefix),
                  key=lambda p: p.stat().st_mtime)
    removed = []
    while len(mine) >= keep:
        oldest = mine.pop(0)
        os.chmod(oldest, 0o600)  # MindSpore chmods before removing its own 0o400 files
        oldest.unlink()
        removed.append(oldest.name)
    return removed


def test_keep_checkpoint_max_rotation_with_a_slow_rank(ms, root, catalog_url):
    keep = 3
    job = MFJob(root / "job", tp=2, dp=1, pp=2)  # 4 ranks, each its own file of a stage
    job.strategy_files()
    earlier = MFJob(root / "job", tp=2, dp=1, pp=2, prefix="old")  # another prefix: never rotated by this one
    earlier.save(5)
    for step in (10, 20, 30):
        job.save(step)
    d = started_daemon(root, catalog_url)
    try:
        def states() -> dict[tuple[str, int], str]:
            d.verifier.drain(timeout=10)
            return {(p, s): st for p, s, st in query(catalog_url, "SELECT prefix, step, state FROM checkpoints")}

        whole = {("old", 5): "verified", **{("llama", s): "verified" for s in (10, 20, 30)}}
        wait_for(lambda: states() == whole, 60, interval=0.2, what=f"states {whole}")
        # ranks 0-2 rotate (step 10 goes) and save step 40; rank 3 is slow: still writing (MindSpore's .tmp)
        for r in (0, 1, 2):
            assert _rotate(job, r, keep) == [job.file_name(r, 10)]
        job.save(40, ranks=[0, 1, 2])
        in_flight = job.rank_dir(3) / (job.path(3, 40).stem + ".tmp")
        in_flight.write_bytes(b"\0" * 4096)

        half = {**whole, ("llama", 10): "deleted", ("llama", 40): "incomplete"}
        wait_for(lambda: states() == half, 60, interval=0.2, what=f"states {half}")
        assert job.path(3, 10).exists()  # rank 3 has not rotated yet: its file alone never makes step 10 whole
        answer = _answer(catalog_url)
        assert answer["global_step"] == 30
        skipped = {s["step"]: s["reason"] for s in answer["skipped"]}
        assert skipped[40].startswith("incomplete") and "ranks [3]" in skipped[40]
        assert 10 not in skipped  # a deleted step is history, not a candidate

        # the slow rank finishes: it rotates its own step 10 and renames its save into place
        assert _rotate(job, 3, keep) == [job.file_name(3, 10)]
        in_flight.unlink()
        job.save(40, ranks=[3])

        wait_for(lambda: states() == {**half, ("llama", 40): "verified"}, 60, interval=0.2, what="step 40 verified")
        answer = _answer(catalog_url)
        assert answer["skipped"] == []
        assert [s["path"] for s in answer["shards"]] == [str(job.path(r, 40)) for r in range(4)]
        assert answer["mindformers"]["resume_training"] == job.file_name(0, 40)
    finally:
        d.stop()
