"""A wrong key is a configuration problem, not corrupt data (issue 15, finding 12): verdicts record
what they depended on, and a daemon restarted with the right key re-verifies them."""

from __future__ import annotations

from pathlib import Path

from ckptd.daemon import Daemon
from ckptd.settings import Settings
from tests.daemon_helpers import query, rank_tensors, started_daemon, step_states, wait_for, write_tp_strategy

KEY = bytes(range(16))
WRONG = bytes(range(16, 32))


def _save_encrypted(ms, path: Path, rank: int, step: int) -> None:
    """Encrypted without a CRC trailer: MindSpore's enc_key + crc_check writes a file it cannot load."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = [{"name": n, "data": ms.Tensor(a)} for n, a in rank_tensors(rank, step).items()]
    ms.save_checkpoint(data, str(path), append_dict={"step_num": step, "rank_id": rank}, enc_key=KEY, enc_mode="AES-GCM")


def _run_until(root: Path, url: str, key_file: Path, want: dict[int, str]) -> None:
    d = started_daemon(root, url, key_file=key_file)
    try:
        def settled():
            d.verifier.drain(timeout=10)
            return step_states(url) == want
        wait_for(settled, 60, what=f"steps {want}")
    finally:
        d.stop()


def test_a_wrong_key_does_not_condemn_the_run_for_good(ms, tmp_path, catalog_url):
    root = tmp_path / "root"
    write_tp_strategy(root / "run")
    for step in (2, 4):
        for rank in range(2):
            _save_encrypted(ms, root / "run" / f"rank_{rank}" / f"net-1_{step}.ckpt", rank, step)
    right, wrong = tmp_path / "right.key", tmp_path / "wrong.key"
    right.write_bytes(KEY)
    wrong.write_bytes(WRONG)
    _run_until(root, catalog_url, wrong, {2: "corrupt", 4: "corrupt"})
    reasons = [r for (r,) in query(catalog_url, "SELECT reason FROM checkpoints")]
    assert all(r.startswith("configuration, not data") and "key" in r for r in reasons), reasons
    _run_until(root, catalog_url, right, {2: "verified", 4: "verified"})  # re-verified, not trusted
    assert query(catalog_url, "SELECT DISTINCT state, error FROM shards") == [("verified", None)]
    stamps = {s for (s,) in query(catalog_url, "SELECT DISTINCT verified_config FROM shards")}
    assert stamps == {Settings(root=root, key_file=right).verification_stamp()}
    # a policy change re-verifies as well: with require_encryption off/on the verdicts are the same
    # here (every shard is encrypted), but they are re-read under the new stamp
    d = Daemon(Settings(root=root, db=catalog_url, key_file=right, require_encryption=True, settle_seconds=0.2,
                        rescan_interval=0.5, debounce=0.02))
    d.start()
    try:
        want = {Settings(root=root, key_file=right, require_encryption=True).verification_stamp()}
        wait_for(lambda: {s for (s,) in query(catalog_url, "SELECT DISTINCT verified_config FROM shards")} == want,
                 60, what="verdicts re-stamped under the new policy")
        assert step_states(catalog_url) == {2: "verified", 4: "verified"}
    finally:
        d.stop()
