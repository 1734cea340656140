"""The alembic migrations and the ORM models describe the same schema (SQLite and PostgreSQL).

The daemon runs on the migrated schema while its queries are written against the models; a column
or index present in one and not the other is a bug that only shows on a real catalog.
"""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from ckptd.catalog.db import make_engine
from ckptd.catalog.models import Base


def test_migrated_schema_matches_the_models(catalog_url):
    engine = make_engine(catalog_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], "models and migrations disagree; add a migration revision:\n" + "\n".join(map(str, diff))


def _alembic(engine):
    import os

    from alembic.config import Config

    import ckptd.migrations

    cfg = Config()
    cfg.set_main_option("script_location", os.path.dirname(ckptd.migrations.__file__))
    cfg.attributes["engine"] = engine
    return cfg


def test_0007_widens_name_numbers_and_fills_plain_incarnations(catalog_url):
    """Down to 0006 and back: steps catalogued before 0007 (native incarnations NULL) get theirs
    from the one rule; epochs beyond 32 bits fit after it, and a downgrade refuses to cut them."""
    import pytest
    from alembic import command
    from sqlalchemy import text

    from ckptd.catalog.db import CatalogError, current_revision, head_revision

    engine = make_engine(catalog_url)
    try:
        command.downgrade(_alembic(engine), "0006")
        assert current_revision(engine) == "0006"
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name, path, layout, created_at) VALUES "
                              "(1, 'plain', '/r/plain', NULL, CURRENT_TIMESTAMP), "
                              "(2, 'mf', '/r/mf', 'mindformers', CURRENT_TIMESTAMP)"))
            steps = [(1, "net", "trained"), (1, "net_1", "trained"), (1, "resnet_50_1", "trained"),
                     (1, "toy_rank_3", "trained"), (1, "net", "breakpoint"), (2, "llama", "trained")]
            for i, (run, prefix, kind) in enumerate(steps, start=1):
                conn.execute(text("INSERT INTO checkpoints (id, run_id, prefix, epoch, step, kind, layout, state, "
                                  "pinned, marked_bad, created_at, updated_at) VALUES (:id, :run, :prefix, 1, 5, "
                                  ":kind, '', 'verified', false, false, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                             {"id": i, "run": run, "prefix": prefix, "kind": kind})
        command.upgrade(_alembic(engine), "head")
        with engine.begin() as conn:
            got = conn.execute(text("SELECT prefix, kind, incarnation FROM checkpoints ORDER BY id")).all()
            assert [tuple(r) for r in got] == [
                ("net", "trained", 0), ("net_1", "trained", 1), ("resnet_50_1", "trained", 51),
                ("toy_rank_3", "trained", None),  # another rank's tag: a misplaced file, no incarnation
                ("net", "breakpoint", None),  # a breakpoint's _n is no restart
                ("llama", "trained", None)]  # not a native run: its names were read at ingest
            conn.execute(text("UPDATE checkpoints SET epoch = :e, incarnation = :e WHERE id = 1"), {"e": 2**62})
        with engine.connect() as conn:
            assert conn.execute(text("SELECT epoch, incarnation FROM checkpoints WHERE id = 1")).one() == (2**62, 2**62)
        if engine.dialect.name == "postgresql":  # SQLite's columns were never narrower
            with pytest.raises(CatalogError, match="beyond 2147483647"):
                command.downgrade(_alembic(engine), "0006")
            assert current_revision(engine) == head_revision()  # refused as a whole: nothing downgraded
            with engine.connect() as conn:  # the refused downgrade changed nothing
                assert conn.execute(text("SELECT epoch FROM checkpoints WHERE id = 1")).scalar() == 2**62
        with engine.begin() as conn:
            conn.execute(text("UPDATE checkpoints SET epoch = 1, incarnation = 0 WHERE id = 1"))
        command.downgrade(_alembic(engine), "0006")
        command.upgrade(_alembic(engine), "head")
        with engine.begin() as conn:
            # the re-created trigger still bumps the run's generation on an incarnation change
            before = conn.execute(text("SELECT generation FROM resume_generations WHERE run_id = 1")).scalar()
            conn.execute(text("UPDATE checkpoints SET incarnation = 7 WHERE id = 2"))
        with engine.connect() as conn:
            assert conn.execute(text("SELECT generation FROM resume_generations WHERE run_id = 1")).scalar() > before
    finally:
        engine.dispose()
    test_migrated_schema_matches_the_models(catalog_url)


def test_0008_shard_copies_down_and_up(catalog_url):
    """0008 adds the table of copies and its resume-generation triggers; down drops both, up restores them."""
    from alembic import command
    from sqlalchemy import inspect, text

    from ckptd.catalog.db import current_revision

    engine = make_engine(catalog_url)
    try:
        command.downgrade(_alembic(engine), "0007")
        assert current_revision(engine) == "0007" and "shard_copies" not in inspect(engine).get_table_names()
        command.upgrade(_alembic(engine), "head")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name, path, created_at) VALUES (1, 'r', '/r', CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO checkpoints (id, run_id, prefix, epoch, step, kind, layout, state, pinned, "
                              "marked_bad, created_at, updated_at) VALUES (1, 1, 'net', 1, 5, 'trained', '', "
                              "'verified', false, false, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO shards (id, checkpoint_id, rank, path, size, mtime_ns, inode, state, "
                              "quarantined, verify_seq, seen_at) VALUES (1, 1, 0, '/r/rank_0/net-1_5.ckpt', 1, 0, 0, "
                              "'verified', false, 0, CURRENT_TIMESTAMP)"))
        gen = "SELECT generation FROM resume_generations WHERE run_id = 1"
        with engine.begin() as conn:
            before = conn.execute(text(gen)).scalar()
            conn.execute(text("INSERT INTO shard_copies (checkpoint_id, rank, tier, location, state, created_at) VALUES "
                              "(1, 0, 'object', 's3://b/r/5/rank_0/net-1_5.ckpt', 'verified', CURRENT_TIMESTAMP)"))
        with engine.begin() as conn:
            after_insert = conn.execute(text(gen)).scalar()
            conn.execute(text("UPDATE shard_copies SET state = 'corrupt'"))
        with engine.begin() as conn:
            after_update = conn.execute(text(gen)).scalar()
            conn.execute(text("UPDATE shard_copies SET error = 'only an error text'"))  # no answer changes
        with engine.connect() as conn:
            assert before < after_insert < after_update == conn.execute(text(gen)).scalar()
    finally:
        engine.dispose()
    test_migrated_schema_matches_the_models(catalog_url)
