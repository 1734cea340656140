"""Ingest's parse check, the step checks' shard facts and a strategy file the catalog holds no
content of read through the confined store, ckptd.storage (issue 15): a FIFO swapped in after the lstat is refused
instead of blocking the thread in open() forever, a symlink is not followed out of the root.
Real files and FIFOs; the reads run in a subprocess with a deadline (a thread blocked in open()
on a FIFO cannot be interrupted)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.daemon_helpers import save_shard

SCRIPT = textwrap.dedent("""
    import sys
    from ckptd.catalog.models import StrategyFile
    from ckptd.service.shardopen import parse_error
    from ckptd.service.stepcheck import ShardRef, shard_facts
    from ckptd.service.stepjudge import StepJudge
    from ckptd.storage import PosixStorage

    root, fifo, link, good = sys.argv[1:5]
    root = PosixStorage(root)
    for path in (fifo, link):
        err = parse_error(root, path, None)
        print("parse", path, err.code if err else None, err)
        facts = shard_facts(root, ShardRef(0, path), None, None)
        print("facts", path, facts.readable, facts.problems)
    print("parse-good", parse_error(root, good, None))
    print("facts-good", shard_facts(root, ShardRef(0, good), None, None).readable)
    judge = StepJudge(root, None, None)
    print("strategy", judge.strategy_for(StrategyFile(path=fifo, content=None, content_hash="h", error=None)))
""")


@pytest.mark.timeout(120)
def test_parse_check_facts_and_strategy_refuse_fifos_and_symlinks(ms, tmp_path):
    root = tmp_path / "root"
    good = save_shard(ms, root, "run", 0, 2)
    outside = save_shard(ms, tmp_path / "elsewhere", "run", 0, 2)
    fifo = good.parent / "net-1_4.ckpt"
    os.mkfifo(fifo)
    link = good.parent / "net-1_6.ckpt"
    link.symlink_to(outside)
    try:
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(root), str(fifo), str(link), str(good)],
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a confined read blocked on the FIFO")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    parse_fifo, facts_fifo, parse_link, facts_link = lines[:4]
    assert f"parse {fifo} confinement" in parse_fifo and "FIFO" in parse_fifo
    assert "False" in facts_fifo and "FIFO" in facts_fifo and str(fifo) in facts_fifo
    assert f"parse {link} confinement" in parse_link and "symlink" in parse_link
    assert "False" in facts_link and "symlink" in facts_link
    assert "/proc/self/fd" not in out.stdout  # errors name the shard, not the descriptor
    assert lines[4:] == ["parse-good None", "facts-good True", "strategy None"]
