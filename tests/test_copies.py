"""The table of copies (issue 21, item 1): every copy of a shard on every tier, and the tiers a step
is whole on, through a real daemon, real MindSpore files, real HTTP and the CLI, on SQLite and
PostgreSQL. The memory and object tiers' writers come with their issues; here their rows are
recorded through the catalog's one entry point (``catalog.copies.record``), as those writers will."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sqlalchemy.orm import Session

from ckptd.catalog import copies
from ckptd.catalog.db import make_engine
from ckptd.catalog.models import Shard
from ckptd.states import ShardState, Tier
from ckptd.storage import file_uri
from tests.api_helpers import Server
from tests.daemon_helpers import fast_settings, query, save_shard, write_tp_strategy

TOKENS = {"r-token": "read", "a-token": "admin"}


@pytest.fixture
def server(root, catalog_url):
    with Server(fast_settings(root, catalog_url, tokens=TOKENS)) as srv:
        yield srv


def _shards(url: str, step: int) -> list[tuple[int, int, str]]:
    """(step id, rank, path) of each shard of ``step``."""
    return query(url, "SELECT c.id, s.rank, s.path FROM shards s JOIN checkpoints c ON c.id = s.checkpoint_id "
                      "WHERE c.step = :step ORDER BY s.rank", step=step)


def _record(url: str, ckpt_id: int, rank: int, tier: Tier, location: str,
            state: ShardState = ShardState.VERIFIED) -> None:
    engine = make_engine(url)
    try:
        with Session(engine) as s, s.begin():
            copies.record(s, ckpt_id, rank, tier, location, state=state, size=123, digest="d" * 32, node="n1")
    finally:
        engine.dispose()


def _generation(url: str) -> int:
    return query(url, "SELECT generation FROM resume_generations g JOIN runs r ON r.id = g.run_id "
                      "WHERE r.name = 'run1'")[0][0]


def _cli(url: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", *argv, "--db", url], capture_output=True, text=True,
                          timeout=120)


def test_a_step_is_whole_on_a_tier_when_every_shard_has_a_verified_copy_there(ms, root, catalog_url, server):
    write_tp_strategy(root / "run1")
    for step in (100, 200):
        for rank in range(2):
            save_shard(ms, root, "run1", rank, step)
    server.settle()
    reader = server.client("r-token")
    steps = {x["step"]: x for x in reader.get("/v1/runs/run1/steps").json()}
    assert {k: v["tiers"] for k, v in steps.items()} == {100: ["file"], 200: ["file"]}

    before = _generation(catalog_url)
    s200, s100 = _shards(catalog_url, 200), _shards(catalog_url, 100)
    for ckpt_id, rank, _ in s200:
        _record(catalog_url, ckpt_id, rank, Tier.OBJECT, f"s3://bucket/ckpt/run1/200/rank_{rank}/net-1_200.ckpt")
    _record(catalog_url, s100[0][0], 0, Tier.OBJECT, "s3://bucket/ckpt/run1/100/rank_0/net-1_100.ckpt")
    # a copy can change where a step is restored from: the resume cache must not outlive it
    assert _generation(catalog_url) > before

    steps = {x["step"]: x for x in reader.get("/v1/runs/run1/steps").json()}
    assert steps[200]["tiers"] == ["file", "object"]
    assert steps[100]["tiers"] == ["file"]  # rank 1 has no object copy: not whole there
    # nor with a copy of a rank the step does not have (rank 7 of a 2-rank step): the listing's
    # rule is the oracle's, ranks 0..n-1 each verified
    _record(catalog_url, s100[0][0], 7, Tier.OBJECT, "s3://bucket/ckpt/run1/100/rank_7/net-1_100.ckpt")
    assert {x["step"]: x["tiers"] for x in reader.get("/v1/runs/run1/steps").json()}[100] == ["file"]

    doc = reader.get("/v1/runs/run1/steps/200").json()
    assert doc["tiers"] == ["file", "object"]
    for sh, (_, rank, path) in zip(doc["shards"], s200):
        assert [(c["tier"], c["location"], c["state"]) for c in sh["copies"]] == [
            ("file", file_uri(path), "verified"),
            ("object", f"s3://bucket/ckpt/run1/200/rank_{rank}/net-1_200.ckpt", "verified")]

    # recording again updates the row (one row per shard, tier and location), never a second one
    _record(catalog_url, s200[1][0], 1, Tier.OBJECT, "s3://bucket/ckpt/run1/200/rank_1/net-1_200.ckpt",
            ShardState.CORRUPT)
    assert query(catalog_url, "SELECT count(*) FROM shard_copies WHERE checkpoint_id = :id AND rank = 1",
                 id=s200[1][0]) == [(1,)]
    assert reader.get("/v1/runs/run1/steps/200").json()["tiers"] == ["file"]

    listed = _cli(catalog_url, "ls", "run1")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert "TIERS" in header.split()
    shown = _cli(catalog_url, "show", "run1", "200")
    assert "whole on: file" in shown.stdout and "copies on other tiers:" in shown.stdout
    assert "s3://bucket/ckpt/run1/200/rank_1/net-1_200.ckpt" in shown.stdout and "corrupt" in shown.stdout
    as_json = json.loads(_cli(catalog_url, "show", "run1", "200", "--json").stdout)
    assert [c["tier"] for c in as_json["shards"][0]["copies"]] == ["file", "object"]

    # a step whose files are torn (rank 1 never saved) but whose every rank is in memory: whole on
    # that tier only, and rank 1's copy is listed though no shard file of it exists
    save_shard(ms, root, "run1", 0, 300)
    server.settle()
    ckpt300 = _shards(catalog_url, 300)[0][0]
    for rank in range(2):
        _record(catalog_url, ckpt300, rank, Tier.MEMORY, f"memory://n1/run1/rank_{rank}/slot_0")
    doc = reader.get("/v1/runs/run1/steps/300").json()
    assert doc["state"] == "incomplete" and doc["tiers"] == ["memory"]
    assert [c["location"] for c in doc["shards"][0]["copies"]][1:] == ["memory://n1/run1/rank_0/slot_0"]
    assert [(c["rank"], c["location"]) for c in doc["copies_without_file"]] == [(1, "memory://n1/run1/rank_1/slot_0")]

    # retention deleting a step deletes its copies' rows with it (on PostgreSQL the foreign key
    # would refuse the shard rows' delete otherwise)
    gc = _cli(catalog_url, "gc", "--run", "run1", "--keep-last", "1", "--root", str(root))
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert query(catalog_url, "SELECT count(*) FROM shard_copies WHERE checkpoint_id = :id", id=s100[0][0]) == [(0,)]
    assert query(catalog_url, "SELECT count(*) FROM shard_copies WHERE checkpoint_id = :id", id=s200[0][0]) == [(2,)]


def test_the_file_tier_is_the_shard_row_itself(root, catalog_url, server):
    """Nobody records a file-tier row: the shard row is that copy (``Tier``'s docstring)."""
    engine = make_engine(catalog_url)
    try:
        with Session(engine) as s:
            with pytest.raises(ValueError, match="shard row itself"):
                copies.record(s, 1, 0, Tier.FILE, "file:///x", state=ShardState.VERIFIED)
            sh = Shard(id=7, rank=0, path="/r/a b%.ckpt", size=1, mtime_ns=0, inode=0, state="verified")
            assert copies.file_copy(sh).location == "file:///r/a%20b%25.ckpt"
    finally:
        engine.dispose()
