"""resume generation: a per-run change counter kept by database triggers

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 02:50:00

The resume oracle caches its answers per run and reuses one only while the run's
``resume_generations.generation`` is unchanged, so a cache hit costs one indexed lookup. The
counter is bumped by triggers, not by ckptd's Python code, so every writer is covered: the
daemon, the CLI, an operator's SQL, other daemons sharing a PostgreSQL catalog.

What bumps it (everything a resume answer is computed from):

* ``checkpoints``: insert, delete, and any update that changes a column other than
  ``lease_until`` / ``updated_at`` / ``created_at`` (the resume call itself renews leases; a lease
  never changes an answer). A new column on ``checkpoints`` must be added to ``CHECKPOINT_COLUMNS``
  in a new revision if it can change an answer.
* ``shards``: insert, delete, a change of checkpoint, rank or path, and a state change into or
  out of ``verified`` (the answer lists the verified shards).
* ``step_health``: rows with a non-finite loss appearing, disappearing or moving.
* ``strategy_files``: a change of path or content hash, or a delete.

PostgreSQL: the triggers are constraint triggers ``DEFERRABLE INITIALLY DEFERRED``, so the counter
row is locked only at commit, after every checkpoint/shard lock the transaction takes — adding
them never inverts the checkpoint-then-shards lock order. A transaction bumps a run once
(``bumped_by`` = its transaction id), however many rows it touched. SQLite has one writer at a
time, so plain row triggers suffice there.

``resume_generations.run_id`` has no foreign key on purpose: a trigger must never make a write
fail (e.g. a run deleted in the same transaction); an orphan counter row is harmless.
"""

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

# checkpoints columns whose change can change a resume answer (all but id, lease_until, *_at)
CHECKPOINT_COLUMNS = ("run_id", "prefix", "epoch", "step", "kind", "layout", "global_step", "state", "expected_ranks",
                      "strategy_id", "step_checks_ok", "reason", "derived_from_id", "pinned", "marked_bad", "bad_reason")


def _changed(columns: tuple[str, ...], distinct: str) -> str:
    return " OR ".join(f"OLD.{c} {distinct} NEW.{c}" for c in columns)


def _conditions(distinct: str) -> dict[tuple[str, str], str | None]:
    """(table, event) -> the row condition under which the event can change an answer (None: always)."""
    verified_moved = f"(OLD.state = 'verified' OR NEW.state = 'verified') AND OLD.state {distinct} NEW.state"
    nonfinite_moved = (f"OLD.loss_nonfinite {distinct} NEW.loss_nonfinite OR (NEW.loss_nonfinite IS NOT NULL AND "
                       f"({_changed(('run_id', 'step'), distinct)}))")
    return {
        ("checkpoints", "INSERT"): None,
        ("checkpoints", "DELETE"): None,
        ("checkpoints", "UPDATE"): _changed(CHECKPOINT_COLUMNS, distinct),
        ("shards", "INSERT"): None,
        ("shards", "DELETE"): None,
        ("shards", "UPDATE"): f"{_changed(('checkpoint_id', 'rank', 'path'), distinct)} OR ({verified_moved})",
        ("step_health", "INSERT"): "NEW.loss_nonfinite IS NOT NULL",
        ("step_health", "DELETE"): "OLD.loss_nonfinite IS NOT NULL",
        ("step_health", "UPDATE"): nonfinite_moved,
        ("strategy_files", "DELETE"): None,
        ("strategy_files", "UPDATE"): _changed(("run_id", "path", "content_hash"), distinct),
    }


def _trigger_name(table: str, event: str) -> str:
    return f"ckptd_resume_gen_{table}_{event.lower()}"


# --- SQLite --------------------------------------------------------------------------------------


def _sqlite_run_ids(table: str, row: str) -> str:
    """A SELECT of the run id an OLD/NEW row belongs to (no row when it belongs to none)."""
    if table == "shards":
        return f"SELECT run_id FROM checkpoints WHERE id = {row}.checkpoint_id"
    return f"SELECT {row}.run_id AS run_id"


def _sqlite_upgrade() -> None:
    for (table, event), condition in _conditions("IS NOT").items():
        rows = {"INSERT": ("NEW",), "DELETE": ("OLD",), "UPDATE": ("OLD", "NEW")}[event]
        run_ids = " UNION ".join(_sqlite_run_ids(table, row) for row in rows)
        # INSERT ... SELECT, not VALUES: a NULL run_id would make SQLite invent a rowid
        body = (f"INSERT OR IGNORE INTO resume_generations (run_id, generation) SELECT run_id, 0 FROM ({run_ids}) "
                f"WHERE run_id IS NOT NULL; "
                f"UPDATE resume_generations SET generation = generation + 1 WHERE run_id IN ({run_ids});")
        when = f"WHEN {condition} " if condition else ""
        op.execute(f"CREATE TRIGGER {_trigger_name(table, event)} AFTER {event} ON {table} FOR EACH ROW {when}"
                   f"BEGIN {body} END")


# --- PostgreSQL ----------------------------------------------------------------------------------

_PG_BUMP = """
CREATE FUNCTION ckptd_bump_resume_generation(rid integer) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF rid IS NULL THEN
        RETURN;
    END IF;
    -- once per transaction and run: later rows of the same transaction find bumped_by = us
    INSERT INTO resume_generations AS g (run_id, generation, bumped_by) VALUES (rid, 1, txid_current())
    ON CONFLICT (run_id) DO UPDATE SET generation = g.generation + 1, bumped_by = EXCLUDED.bumped_by
    WHERE g.bumped_by IS DISTINCT FROM EXCLUDED.bumped_by;
END $$
"""


def _pg_function(table: str) -> str:
    if table == "shards":  # resolved at commit; a checkpoint deleted meanwhile bumps through its own trigger
        old = "(SELECT run_id FROM checkpoints WHERE id = OLD.checkpoint_id)"
        new = "(SELECT run_id FROM checkpoints WHERE id = NEW.checkpoint_id)"
    else:
        old, new = "OLD.run_id", "NEW.run_id"
    return f"""
CREATE FUNCTION ckptd_resume_gen_{table}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM ckptd_bump_resume_generation({old});
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM ckptd_bump_resume_generation({new});
    END IF;
    RETURN NULL;
END $$
"""


def _pg_upgrade() -> None:
    op.execute(_PG_BUMP)
    for table in ("checkpoints", "shards", "step_health", "strategy_files"):
        op.execute(_pg_function(table))
    for (table, event), condition in _conditions("IS DISTINCT FROM").items():
        when = f"WHEN ({condition}) " if condition else ""
        op.execute(f"CREATE CONSTRAINT TRIGGER {_trigger_name(table, event)} AFTER {event} ON {table} "
                   f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW {when}EXECUTE FUNCTION ckptd_resume_gen_{table}()")


def upgrade() -> None:
    op.create_table(
        'resume_generations',
        sa.Column('run_id', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('generation', sa.BigInteger(), nullable=False),
        sa.Column('bumped_by', sa.BigInteger(), nullable=True),  # PostgreSQL: the last bumping transaction
        sa.PrimaryKeyConstraint('run_id'),
    )
    if op.get_bind().dialect.name == "postgresql":
        _pg_upgrade()
    else:
        _sqlite_upgrade()


def downgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    for table, event in _conditions("IS NOT"):
        op.execute(f"DROP TRIGGER IF EXISTS {_trigger_name(table, event)}" + (f" ON {table}" if pg else ""))
    if pg:
        for table in ("checkpoints", "shards", "step_health", "strategy_files"):
            op.execute(f"DROP FUNCTION IF EXISTS ckptd_resume_gen_{table}()")
        op.execute("DROP FUNCTION IF EXISTS ckptd_bump_resume_generation(integer)")
    op.drop_table('resume_generations')
