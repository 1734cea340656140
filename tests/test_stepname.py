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
