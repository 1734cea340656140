"""Steps named as users count them (issue 25, item 3): the rule, as a table."""

import pytest

from ckptd import stepname


@pytest.mark.parametrize("global_step, shards_step, epoch, name_step, users, note, label", [
    (12, 12, 2, 6, 12, "files named epoch 2 step 6", "12(epoch2_step6)"),  # verified, 6-step epochs
    (None, 12, 2, 6, 12, "files named epoch 2 step 6", "12(epoch2_step6)"),  # torn: rank 0's shard verified
    (None, None, 2, 6, None, "files named epoch 2 step 6; the global step is read once a shard verifies",
     "epoch2_step6"),
    (None, None, 1, 4, 4, None, "4"),  # the first epoch's step is the global step
    (None, None, 0, 4, 4, None, "4"),  # MindFormers' epoch 0 / no epoch in the name
    (600, None, 1, 600, 600, None, "600"),  # Checkpoint 2.0: the iteration is the global step
    (7, None, 1, 3, 7, "files named epoch 1 step 3", "7(epoch1_step3)"),  # a resumed offset the content says
])
def test_users_step_note_and_label(global_step, shards_step, epoch, name_step, users, note, label):
    assert stepname.users_step(global_step, shards_step, epoch, name_step) == users
    assert stepname.file_name_note(epoch, name_step, users) == note
    assert stepname.label(global_step, shards_step, epoch, name_step) == label


def test_run_rows_name_the_newest_restorable_step_by_its_global_step(ms, root, tmp_path):
    """``GET /v1/runs`` and ``ckptd ls``'s LATEST RESTORABLE column (both ``run_dict``): a plain job
    with 6-step epochs names global step 12 ``net-2_6.ckpt``; the run row says 12, not 6, and a step
    marked bad is not the latest restorable one."""
    from sqlalchemy.orm import sessionmaker

    from ckptd.catalog.db import make_engine
    from ckptd.service.catalog import get_run, mark_bad, run_dict
    from tests.daemon_helpers import migrated_sqlite, query, started_daemon, wait_for

    url = migrated_sqlite(tmp_path / "catalog.db")
    rank_dir = root / "job" / "rank_0"
    rank_dir.mkdir(parents=True)
    for epoch, name_step, global_step in ((1, 6, 6), (2, 3, 9), (2, 6, 12)):
        ms.save_checkpoint([{"name": "w", "data": ms.Tensor([float(global_step)])}],
                           str(rank_dir / f"net-{epoch}_{name_step}.ckpt"),
                           append_dict={"epoch_num": epoch, "step_num": global_step})
    d = started_daemon(root, url)
    try:
        wait_for(lambda: [r[0] for r in query(url, "SELECT state FROM checkpoints")] == ["verified"] * 3, 60,
                 what="three verified steps")
    finally:
        d.stop()
    engine = make_engine(url)
    try:
        sessions = sessionmaker(engine, expire_on_commit=False)
        with sessions.begin() as s:
            assert run_dict(s, get_run(s, "job"))["latest_restorable_step"] == 12
        with sessions.begin() as s:
            mark_bad(s, "job", 12, "loss spike")
        with sessions.begin() as s:
            assert run_dict(s, get_run(s, "job"))["latest_restorable_step"] == 9
    finally:
        engine.dispose()
