"""Integers read off file names never stop a rescan (issue 26, item 1).

A name like ``llama-2147483648_5.ckpt`` is a legal MindSpore name whose epoch did not fit the
32-bit ``checkpoints.epoch`` on PostgreSQL: the insert failed, the whole rescan with it, so no
file present at start was ever catalogued and ``ckptd launch`` waited for a first rescan that
never finished. Numbers the catalog cannot hold (beyond BIGINT; ranks or restart suffixes beyond
any job) are refused one file at a time, logged once with the reason; everything else in the
root is catalogued, verified and restorable. Real MindSpore files, a real daemon, both databases.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from ckptd import runlayout
from tests.daemon_helpers import query, resume_answer, started_daemon, wait_or_stop

HUGE = "99999999999999999999"  # > 2**63 - 1


def _save(ms, path: Path, step: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = [{"name": "w", "data": ms.Tensor(np.full((4, 2), float(step), np.float32))}]
    ms.save_checkpoint(data, str(path), append_dict={"step_num": step, "rank_id": 0}, crc_check=True)
    return path


def test_one_name_never_stops_the_rescan(ms, root, catalog_url, caplog):
    big = root / "big" / "rank_0"
    _save(ms, big / "llama-1_5.ckpt", 5)
    wide = _save(ms, big / f"llama-{2**31}_5.ckpt", 10)  # fits BIGINT, not INTEGER: catalogued exactly
    bad = root / "bad" / "rank_0"
    good = _save(ms, bad / "llama-1_5.ckpt", 5)
    refused = [
        _save(ms, bad / f"llama-{HUGE}_6.ckpt", 6),  # epoch beyond BIGINT
        _save(ms, bad / f"llama-1_{HUGE}.ckpt", 7),  # step beyond BIGINT
        _save(ms, bad / f"llama_rank_0_{HUGE}-1_8.ckpt", 8),  # restart suffix beyond BIGINT
        _save(ms, bad / f"llama_rank_0_{2**31}-1_9.ckpt", 9),  # ... and beyond any restart count
    ]
    planted = _save(ms, root / "bad" / f"rank_{2**40}" / "llama-1_5.ckpt", 5)  # a rank no job has
    caplog.set_level(logging.WARNING, logger="ckptd")

    def settled():
        rows = query(catalog_url, "SELECT r.name, c.epoch, c.step, c.state FROM checkpoints c "
                                  "JOIN runs r ON r.id = c.run_id ORDER BY r.name, c.epoch")
        return rows if d.watcher.rescans >= 3 and all(state == "verified" for *_, state in rows) else None

    d = started_daemon(root, catalog_url)
    wait_or_stop(d, settled, 60, "the root catalogued over three rescans")
    d.stop()
    assert d.watcher.ready.is_set()  # what `ckptd launch` waits for (healthz first_rescan_done)
    assert settled() == [("bad", 1, 5, "verified"), ("big", 1, 5, "verified"), ("big", 2**31, 5, "verified")]
    assert query(catalog_url, "SELECT path FROM shards ORDER BY path") == sorted(
        [(str(good),), (str(big / "llama-1_5.ckpt"),), (str(wide),)])
    answer = resume_answer(catalog_url, "big")
    assert (answer["epoch"], answer["global_step"], [s["path"] for s in answer["shards"]]) == (2**31, 10, [str(wide)])
    answer = resume_answer(catalog_url, "bad")
    assert (answer["epoch"], answer["global_step"], [s["path"] for s in answer["shards"]]) == (1, 5, [str(good)])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a name"
    for path in refused:  # one line each, with the reason, however many rescans saw it
        lines = [m for m in warnings if repr(str(path)) in m]
        assert len(lines) == 1 and "beyond" in lines[0], (path, lines)
    lines = [m for m in warnings if repr(str(planted.parent)) in m]
    assert len(lines) == 1 and "rank" in lines[0], lines


@pytest.mark.parametrize("name, why", [
    (f"llama-{HUGE}_5.ckpt", "epoch"),
    (f"llama-1_{HUGE}.ckpt", "step"),
    (f"llama_rank_0_{2**20 + 1}-1_5.ckpt", "restart"),
])
def test_the_reason_names_the_number(name, why):
    reason = runlayout.unusable_name(name)
    assert reason is not None and why in reason and "beyond" in reason
    assert runlayout.classify("/ckpt", f"/ckpt/run/rank_0/{name}") is None


def test_numbers_the_catalog_holds_are_kept_exactly():
    name = runlayout.classify("/ckpt", f"/ckpt/run/rank_0/llama-{2**63 - 1}_{2**63 - 1}.ckpt")
    assert (name.epoch, name.step) == (2**63 - 1, 2**63 - 1)
    assert runlayout.unusable_name(f"llama-{2**63 - 1}_1.ckpt") is None
    assert runlayout.parse_rank_dir(f"rank_{runlayout.MAX_RANK}") == runlayout.MAX_RANK
    assert runlayout.parse_rank_dir(f"rank_{runlayout.MAX_RANK + 1}") is None
    assert "rank" in runlayout.unusable_dir(f"rank_{runlayout.MAX_RANK + 1}")
    assert runlayout.unusable_dir("rank_3") is None and runlayout.unusable_dir("notes") is None
    assert runlayout.rank_strategy_rank(f"ckpt_strategy_rank_{runlayout.MAX_RANK + 1}.ckpt") is None
    assert runlayout.classify("/ckpt", f"/ckpt/run/strategy/ckpt_strategy_rank_{HUGE}.ckpt") is None
    assert runlayout.parse_iteration_dir(f"iteration_{HUGE}") is None
    assert "iteration" in runlayout.unusable_dir(f"iteration_{HUGE}")
    assert runlayout.unusable_name(f"toy-model-0000000-{HUGE}.safetensors", runlayout.CKPT2) is not None
    assert runlayout.unusable_name("x" * 5000 + f"-1_{'9' * 5000}.ckpt") is not None  # never converted to an int
