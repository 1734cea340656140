"""Step checks reuse what verification read: the facts of an encrypted or large shard (content step,
rank, slice shapes, replica digests) are taken from the file the verifier has open and stored with
the verdict, so the step check does not decrypt or read it again (issue 16); a small plaintext
shard is re-indexed from the index cache instead (see ``verifier.FACTS_IN_PASS_BYTES``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ckptd.catalog.models import Checkpoint
from ckptd.daemon import Daemon
from ckptd.service.stepcheck import ShardFacts, ShardRef, shard_facts
from ckptd.service.verifier import FACTS_IN_PASS_BYTES
from ckptd.storage import PosixStorage
from tests.daemon_helpers import fast_settings, query, rank_tensors, step_states, wait_for, write_tp_strategy

KEY = bytes(range(16))


def _save(ms, root, rank: int, encrypted: bool, big: bool):
    """A tp2 shard by mindspore.save_checkpoint (encrypted ones without CRC: MindSpore cannot load
    enc_key + crc_check files back); ``big``: past FACTS_IN_PASS_BYTES (a replicated extra tensor)."""
    path = root / "job" / f"rank_{rank}" / "net-1_10.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = rank_tensors(rank, 10) | ({"pad": np.ones(FACTS_IN_PASS_BYTES // 4 + 1, np.float32)} if big else {})
    data = [{"name": n, "data": ms.Tensor(a)} for n, a in tensors.items()]
    extra = {"enc_key": KEY, "enc_mode": "AES-GCM"} if encrypted else {"crc_check": True}
    ms.save_checkpoint(data, str(path), append_dict={"step_num": 10, "rank_id": rank}, **extra)
    return path


@pytest.mark.parametrize("encrypted, big", [(False, False), (True, False), (False, True)],
                         ids=["small-plain", "aes-gcm", "large-plain"])
def test_verification_records_the_step_checks_facts(ms, tmp_path, catalog_url, encrypted, big):
    root = tmp_path / "root"
    write_tp_strategy(root / "job")
    paths = [_save(ms, root, rank, encrypted, big) for rank in range(2)]
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    settings = fast_settings(root, catalog_url, key_file=key_file if encrypted else None)
    d = Daemon(settings)
    d.start()
    try:
        wait_for(lambda: step_states(catalog_url) == {10: "verified"}, 30, what="step 10 verified")
        with d.sessions() as s:
            plan = d.verifier.steps.facts_plan(s, s.get(Checkpoint, query(catalog_url, "SELECT id FROM checkpoints")[0][0]))
    finally:
        d.stop()
    rows = query(catalog_url, "SELECT rank, path, verify_seq, facts FROM shards ORDER BY rank")
    assert [r[1] for r in rows] == [str(p) for p in paths]
    assert query(catalog_url, "SELECT step_checks_ok, global_step FROM checkpoints") == [(True, 10)]
    if not (encrypted or big):
        assert [facts for *_, facts in rows] == [None, None]  # the step check read them from the index cache
        return
    for rank, path, seq, facts in rows:
        doc = json.loads(facts)  # recorded by the verification, not by a second read in the step check
        assert (doc["stamp"], doc["seq"]) == (plan.stamp, seq)
        fresh = shard_facts(PosixStorage(str(root)), ShardRef(rank, path), plan.strategy, KEY if encrypted else None, plan.names,
                            subset=plan.subset)
        assert ShardFacts.decode(doc["facts"]) == fresh and fresh.step == 10 and fresh.shapes_ok
