"""The object tier's loop (``ObjectTier.run_once``) against a real S3 server (SeaweedFS): a shard
whose bytes changed since verification is refused once, backed off and handed back to the
verifier; object retention runs only when the tier changed (or every ``object_gc_interval``).

The catalog is built by a real daemon without an object tier; the tier is then driven pass by pass
with a fake clock, so the back-off is observed without waiting it out.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import sessionmaker

from daemon_helpers import fast_settings, migrated_sqlite, query, save_tp_step, started_daemon, step_states, wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def verified_catalog(ms, tmp_path: Path, steps=(1,)):
    """A catalog whose ``steps`` of run ``job`` are verified (by a real daemon, now stopped)."""
    root = tmp_path / "root"
    root.mkdir()
    url = migrated_sqlite(tmp_path / "cat.db")
    d = started_daemon(root, url, memory_root=None, gc_keep_last=0)
    try:
        for step in steps:
            save_tp_step(ms, root, "job", step)
        wait_for(lambda: all(step_states(url).get(s) == "verified" for s in steps), timeout=90, what="verified steps")
    finally:
        d.stop()
    return root, url


def tier(root: Path, url: str, prefix: str, clock: Clock, requeued: list, **kw):
    from ckptd.catalog.db import make_engine
    from ckptd.service.objtier import ObjectTier
    from ckptd.storage.s3 import ObjectStore

    cfg = fast_settings(root, url, memory_root=None)
    sessions = sessionmaker(make_engine(url), expire_on_commit=False)
    return ObjectTier(sessions, cfg.storage, ObjectStore(f"s3://ckptd/{prefix}"), cfg.node_name,
                      requeue=requeued.extend, clock=clock, **kw)


def test_changed_shard_is_uploaded_once_backed_off_and_requeued(ms, s3env, tmp_path):
    from ckptd.service.objtier import REFUSED_BACKOFF

    root, url = verified_catalog(ms, tmp_path)
    shard = root / "job" / "rank_1" / "net-1_1.ckpt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the read-back can tell
    shard.write_bytes(bytes(data))

    clock, requeued = Clock(), []
    t = tier(root, url, "changed", clock, requeued)
    puts = []
    real_put = t.objects.put_file
    t.objects.put_file = lambda key, path: puts.append(key) or real_put(key, path)

    assert t.run_once() == 0.5  # the pass goes on: the other rank is uploaded
    assert [k for k in puts if k.endswith("rank_1/net-1_1.ckpt")] == ["job/1/rank_1/net-1_1.ckpt"]
    assert t.shard_failures == 1 and len(requeued) == 1
    # the changed rank is not recorded; the other is up but not committed (no manifest)
    assert dict(query(url, "SELECT rank, state FROM shard_copies WHERE tier = 'object'")) == {0: "complete"}
    assert "job/1/rank_1/net-1_1.ckpt" not in dict(t.objects.list(""))

    for _ in range(5):  # passes within the back-off leave it alone
        clock.now += REFUSED_BACKOFF / 10
        t.run_once()
    assert len([k for k in puts if k.endswith("rank_1/net-1_1.ckpt")]) == 1 and len(requeued) == 1
    assert t.passes == 6

    clock.now += REFUSED_BACKOFF  # past it: tried once more, refused again, the back-off doubled
    t.run_once()
    assert len([k for k in puts if k.endswith("rank_1/net-1_1.ckpt")]) == 2 and len(requeued) == 2
    clock.now += REFUSED_BACKOFF * 1.5
    t.run_once()
    assert len([k for k in puts if k.endswith("rank_1/net-1_1.ckpt")]) == 2
    t.objects.close()


def test_unopenable_shard_does_not_abort_the_pass(ms, s3env, tmp_path):
    root, url = verified_catalog(ms, tmp_path)
    (root / "job" / "rank_1" / "net-1_1.ckpt").unlink()
    clock, requeued = Clock(), []
    t = tier(root, url, "gone", clock, requeued)
    assert t.run_once() == 0.5
    assert t.problem is None and t.shard_failures == 1 and len(requeued) == 1
    assert "job/1/rank_0/net-1_1.ckpt" in dict(t.objects.list(""))
    t.objects.close()


def test_retention_runs_only_when_the_tier_changed_or_its_interval_passed(ms, s3env, tmp_path):
    from ckptd.policy import RetentionPolicy

    root, url = verified_catalog(ms, tmp_path, steps=(1, 2))
    clock, requeued = Clock(), []
    t = tier(root, url, "cadence", clock, requeued, upload_every=2, gc_interval=300.0,
             policy=RetentionPolicy(keep_last=10))
    t.run_once()  # a new daemon runs it once; step 2 is committed before it in the same pass
    assert t.gc_runs == 1 and len(query(url, "SELECT id FROM shard_copies WHERE tier = 'object' AND state = 'verified'")) == 2
    for _ in range(3):
        clock.now += 1
        t.run_once()
    assert t.gc_runs == 1  # nothing changed: no retention pass over the tier
    t.upload_every = 1  # step 1 becomes due: a new manifest
    t.run_once()
    assert t.gc_runs == 2
    clock.now += 1
    t.run_once()
    assert t.gc_runs == 2
    clock.now += 300
    t.run_once()
    assert t.gc_runs == 3 and t.passes == 7
    assert t.shard_failures == 0 and t.shard_attempts == 4 and not requeued
    t.objects.close()


def test_object_gc_interval_from_the_config_file(tmp_path, monkeypatch):
    from ckptd.settings import Settings

    cfg = tmp_path / "ckptd.toml"
    cfg.write_text("object_gc_interval = 42.5\n")
    monkeypatch.setenv("CKPTD_CONFIG", str(cfg))
    assert Settings(root=tmp_path).object_gc_interval == 42.5
    assert Settings(root=tmp_path, object_gc_interval=300).object_gc_interval == 300


def test_healthz_shows_the_loop_counters(ms, s3env, tmp_path):
    from api_helpers import Server

    root = tmp_path / "root"
    root.mkdir()
    cfg = fast_settings(root, migrated_sqlite(tmp_path / "cat.db"), object_store="s3://ckptd/health", memory_root=None,
                        gc_keep_last=0, object_keep_last=5)
    with Server(cfg) as srv, srv.client() as c:
        save_tp_step(ms, root, "job", 1)
        tier_status = wait_for(lambda: (o := c.get("/healthz").json()["object_tier"])["gc_runs"] >= 2 and o,
                               timeout=90, what="step 1 committed and retention run after it")
    assert tier_status["problem"] is None and tier_status["passes"] >= 2
    assert tier_status["shard_attempts"] == 2 and tier_status["shard_failures"] == 0


def test_to_upload_picks_a_few_newest_steps_in_sql_and_never_retired_ones(tmp_path):
    from bench.objtier_loop import build
    from ckptd.catalog import objrows
    from ckptd.catalog.db import make_engine

    url = f"sqlite:///{tmp_path / 'cat.db'}"
    build(url, steps=50, ranks=2, pending=23, retired=20)  # 1-20 retired by object retention, 28-50 pending
    engine = make_engine(url)
    with sessionmaker(engine)() as s:
        assert [u.step for u in objrows.to_upload(s, "n1", 1)] == [50, 49, 48, 47]
        assert [u.step for u in objrows.to_upload(s, "n1", 10, limit=8)] == [50, 40, 30]
        assert objrows.to_upload(s, "other", 1) == []
        (top,) = objrows.to_upload(s, "n1", 1, limit=1)
        held = {sid: digest for sid, _rank, _path, _size, digest in top.shards}
        assert [u.step for u in objrows.to_upload(s, "n1", 1, limit=2, skip=held)] == [49, 48]
        # a new verdict (another digest) is not held back
        assert [u.step for u in objrows.to_upload(s, "n1", 1, limit=1, skip=dict.fromkeys(held, "0" * 32))] == [50]
    engine.dispose()
