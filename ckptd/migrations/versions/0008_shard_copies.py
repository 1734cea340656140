"""a table of copies: every copy of a shard on a tier other than the file tier

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 08:00:00

Issue 21 (item 1): the memory tier (flash checkpoints) and the object tier are new backends and
new rows, not new code paths. ``shard_copies`` holds one row per copy of a rank's shard of a step
on a tier (``tier`` = memory | object, ``location`` = the backend's URI, ``state`` = a shard state
with the same promises, the copy's size and xxh3-128 digest, the node holding or writing it),
keyed by step and rank: a memory snapshot of a step never saved to files has no shard row. The
file tier's copy of a shard is the shard row itself (``ckptd.states.Tier``): nothing is back-filled.

A copy appearing, disappearing or moving into or out of ``verified`` can change where a step may
be restored from, so it bumps the run's resume generation (0002) like a shard does.
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

TABLE = "shard_copies"
#: (event, the row condition under which it can change a resume answer; None: always)
EVENTS = {
    "INSERT": None,
    "DELETE": None,
    "UPDATE": "OLD.checkpoint_id {d} NEW.checkpoint_id OR OLD.rank {d} NEW.rank OR OLD.location {d} NEW.location OR "
              "((OLD.state = 'verified' OR NEW.state = 'verified') AND OLD.state {d} NEW.state)",
}
_RUN_OF = "(SELECT run_id FROM checkpoints WHERE id = {row}.checkpoint_id)"


def _trigger(event: str) -> str:
    return f"ckptd_resume_gen_{TABLE}_{event.lower()}"


def _condition(event: str, distinct: str) -> str | None:
    template = EVENTS[event]
    return None if template is None else template.format(d=distinct)


def _sqlite_triggers() -> None:
    for event in EVENTS:
        rows = {"INSERT": ("NEW",), "DELETE": ("OLD",), "UPDATE": ("OLD", "NEW")}[event]
        run_ids = " UNION ".join(f"SELECT {_RUN_OF.format(row=row)} AS run_id" for row in rows)
        body = (f"INSERT OR IGNORE INTO resume_generations (run_id, generation) SELECT run_id, 0 FROM ({run_ids}) "
                f"WHERE run_id IS NOT NULL; "
                f"UPDATE resume_generations SET generation = generation + 1 WHERE run_id IN ({run_ids});")
        condition = _condition(event, "IS NOT")
        when = f"WHEN {condition} " if condition else ""
        op.execute(f"CREATE TRIGGER {_trigger(event)} AFTER {event} ON {TABLE} FOR EACH ROW {when}BEGIN {body} END")


def _pg_triggers() -> None:
    op.execute(f"""
CREATE FUNCTION ckptd_resume_gen_{TABLE}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM ckptd_bump_resume_generation({_RUN_OF.format(row='OLD')});
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM ckptd_bump_resume_generation({_RUN_OF.format(row='NEW')});
    END IF;
    RETURN NULL;
END $$
""")
    for event in EVENTS:
        condition = _condition(event, "IS DISTINCT FROM")
        when = f"WHEN ({condition}) " if condition else ""
        op.execute(f"CREATE CONSTRAINT TRIGGER {_trigger(event)} AFTER {event} ON {TABLE} DEFERRABLE INITIALLY "
                   f"DEFERRED FOR EACH ROW {when}EXECUTE FUNCTION ckptd_resume_gen_{TABLE}()")


def upgrade() -> None:
    op.create_table(
        TABLE,
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('checkpoint_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('tier', sa.String(length=16), nullable=False),
        sa.Column('location', sa.Text(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('size', sa.BigInteger(), nullable=True),
        sa.Column('digest', sa.String(length=64), nullable=True),
        sa.Column('node', sa.String(length=255), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('verified_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('checkpoint_id', 'rank', 'tier', 'location'),
    )
    op.create_index('ix_shard_copies_checkpoint_id', TABLE, ['checkpoint_id'])
    op.create_index('ix_shard_copies_tier_state', TABLE, ['tier', 'state'])
    if op.get_bind().dialect.name == "postgresql":
        _pg_triggers()
    else:
        _sqlite_triggers()


def downgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    for event in EVENTS:
        op.execute(f"DROP TRIGGER IF EXISTS {_trigger(event)}" + (f" ON {TABLE}" if pg else ""))
    if pg:
        op.execute(f"DROP FUNCTION IF EXISTS ckptd_resume_gen_{TABLE}()")
    op.drop_index('ix_shard_copies_tier_state', table_name=TABLE)
    op.drop_index('ix_shard_copies_checkpoint_id', table_name=TABLE)
    op.drop_table(TABLE)
