"""A plain MindSpore job restarted into its directory: each save's incarnation, and the newer wins a tie.

MindSpore's ``ModelCheckpoint``, finding files of its prefix in the directory, saves under
``<prefix>_<k>`` (``_chg_ckpt_file_name_if_same_exist``): a job restarted from scratch re-saves
the same step numbers as ``net_1-1_<s>.ckpt``. Issue 25: ckptd read the incarnation only after a
MindFormers rank tag, so a plain job's steps had none and a tied step could resume from the older
attempt's files. Here a real ``Model.train`` runs twice (two processes) into one rank directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.orm import sessionmaker

from ckptd.catalog.db import make_engine
from ckptd.service.catalog import get_run, get_step
from ckptd.service.resume import ResumeOptions, resume
from tests.daemon_helpers import query, started_daemon, wait_or_stop

JOB = """
import sys
import numpy as np
import mindspore as ms
from mindspore import nn, dataset as ds
from mindspore.train import Model, ModelCheckpoint, CheckpointConfig

ms.set_context(device_target="CPU", mode=ms.PYNATIVE_MODE)
directory, seed = sys.argv[1], int(sys.argv[2])
ms.set_seed(seed)
rng = np.random.default_rng(seed)
data = ds.NumpySlicesDataset({"x": rng.standard_normal((8, 4)).astype(np.float32),
                              "y": rng.standard_normal((8, 1)).astype(np.float32)}, shuffle=False).batch(2)
net = nn.Dense(4, 1)
model = Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.01))
cfg = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10, append_info=["epoch_num", "step_num"])
model.train(1, data, callbacks=[ModelCheckpoint(prefix="net", directory=directory, config=cfg)],
            dataset_sink_mode=False)
"""


@pytest.fixture(scope="module")
def restarted(tmp_path_factory) -> Path:
    """The root of one run whose job ran twice into ``rank_0`` (4 steps, a save every 2)."""
    root = tmp_path_factory.mktemp("inc") / "root"
    rank_dir = root / "job" / "rank_0"
    rank_dir.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_v="3")
    for seed in (1, 2):  # two attempts, two processes: the second finds the first one's files
        proc = subprocess.run([sys.executable, "-c", JOB, str(rank_dir), str(seed)], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in rank_dir.iterdir() if p.suffix == ".ckpt")
    assert names == ["net-1_2.ckpt", "net-1_4.ckpt", "net_1-1_2.ckpt", "net_1-1_4.ckpt"], names
    return root


def test_restarted_plain_job_incarnations_and_the_newer_wins_a_tie(restarted, catalog_url):
    d = started_daemon(restarted, catalog_url)

    def settled():
        rows = query(catalog_url, "SELECT prefix, step, incarnation, global_step, state FROM checkpoints "
                                  "ORDER BY step, prefix")
        return rows if len(rows) == 4 and all(state == "verified" for *_, state in rows) else None

    try:
        wait_or_stop(d, settled, 60, "four verified steps")
    finally:
        d.stop()
    # the step's identity keeps the whole prefix; the suffix is its incarnation (0 for the first)
    assert settled() == [("net", 2, 0, 2, "verified"), ("net_1", 2, 1, 2, "verified"),
                         ("net", 4, 0, 4, "verified"), ("net_1", 4, 1, 4, "verified")]
    engine = make_engine(catalog_url)
    try:
        with sessionmaker(engine).begin() as s:
            answer = resume(s, "job", ResumeOptions(lease=False))
            rank_dir = restarted / "job" / "rank_0"
            assert (answer["global_step"], answer["incarnation"], answer["prefix"]) == (4, 1, "net_1")
            assert [sh["path"] for sh in answer["shards"]] == [str(rank_dir / "net_1-1_4.ckpt")]
            # step 4 is a tie of two saves: the newer attempt's is skipped over by nothing ...
            assert answer["skipped"] == []
            # ... and a step path (/v1/runs/job/steps/2) means the newer attempt's save too
            assert get_step(s, get_run(s, "job"), 2).prefix == "net_1"
            answer = resume(s, "job", ResumeOptions(lease=False, max_step=2))
            assert [sh["path"] for sh in answer["shards"]] == [str(rank_dir / "net_1-1_2.ckpt")]
    finally:
        engine.dispose()


def test_default_retention_covers_every_incarnation_and_torn_temp_files(restarted, catalog_url, tmp_path):
    """Issue 25, item 5: the daemon's own retention loop (on by default) deletes old steps of every
    incarnation -- MindSpore's keep_checkpoint_max only rotates the current prefix -- and the temp
    file of a save killed mid-write once untouched for gc_torn_grace; never the newest restorable
    step, a pinned one, or a temp file still being written."""
    import shutil
    import time

    from ckptd.service.catalog import pin
    from ckptd.settings import Settings

    assert Settings(root=tmp_path, db="sqlite://").gc_keep_last == 5  # on unless turned off
    root = tmp_path / "root"
    shutil.copytree(restarted, root)
    rank_dir = root / "job" / "rank_0"
    torn, writing = rank_dir / "net-1_6.tmp", rank_dir / "net_1-1_6.tmp"
    torn.write_bytes(b"half a save")
    writing.write_bytes(b"being written")
    os.utime(torn, (time.time() - 7200, time.time() - 7200))
    (rank_dir / "notes.tmp").write_bytes(b"not a shard's")
    os.utime(rank_dir / "notes.tmp", (time.time() - 7200, time.time() - 7200))

    d = started_daemon(root, catalog_url, gc_keep_last=0)  # retention off: catalogue, then pin
    try:
        wait_or_stop(d, lambda: len(query(catalog_url, "SELECT id FROM checkpoints WHERE state = 'verified'")) == 4
                     or None, 60, "four verified steps")
    finally:
        d.stop()
    engine = make_engine(catalog_url)
    try:
        with sessionmaker(engine).begin() as s:
            pin(s, "job", 2)  # step 2 names the newer attempt's save: net_1-1_2
    finally:
        engine.dispose()
    d = started_daemon(root, catalog_url, gc_keep_last=1, gc_interval=0.5, gc_torn_grace=3600)
    try:
        wait_or_stop(d, lambda: not torn.exists() and len(query(catalog_url, "SELECT id FROM checkpoints")) == 2
                     or None, 60, "retention to run")
    finally:
        d.stop()
    kept = sorted(p.name for p in rank_dir.iterdir())
    assert kept == ["net_1-1_2.ckpt", "net_1-1_4.ckpt", "net_1-1_6.tmp", "notes.tmp"], kept
    rows = query(catalog_url, "SELECT prefix, step, pinned FROM checkpoints ORDER BY step")
    assert [(p, st, bool(pn)) for p, st, pn in rows] == [("net_1", 2, True), ("net_1", 4, False)]
