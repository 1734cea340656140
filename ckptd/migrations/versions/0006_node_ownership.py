"""node ownership: daemons register with a heartbeat; every shard records the node that sees it

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 10:00:00

Several daemons can share one catalog, each watching its node's disk mounted at the same path.
Only the node that sees a file may judge it (mark it changed or gone, verify, scrub, delete it):

* ``nodes``: one row per daemon node name, with its last heartbeat; a node silent past
  ``node_timeout`` is *unreachable* (its shards keep their last verdict).
* ``shards.node``: the node that saw the file. Rows from before this revision have NULL — a
  placeholder that the first node whose rescan sees the file claims (documented in
  docs/ARCHITECTURE.md, *Nodes*).
* ``shards.claimed_by``: the node verifying the shard now (several daemons on one shared root
  split the work; a claim of an unreachable node is taken over).
* ``shards.facts``: what the owning node's step check found in its file (JSON), so a step whose
  files live on several nodes is checked as a whole without any node reading another's files.

``shards.verified_config`` (issue 15, finding 12): a fingerprint of the configuration a verdict
depended on (the key, ``require_crc``, ``require_encryption``); a daemon started with another
configuration re-verifies those verdicts instead of trusting them — a wrong key must not leave a
healthy run ``corrupt`` for good. NULL on older rows (re-verified when their verdict was a
configuration problem).

A change of ``shards.node`` can change a resume answer (it names each shard's node), so the shards
UPDATE trigger of 0002 is re-created with it.
"""

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

TRIGGER = "ckptd_resume_gen_shards_update"
_VERIFIED_MOVED = "(OLD.state = 'verified' OR NEW.state = 'verified') AND OLD.state {d} NEW.state"


def _condition(columns: tuple[str, ...], d: str) -> str:
    changed = " OR ".join(f"OLD.{c} {d} NEW.{c}" for c in columns)
    return f"{changed} OR ({_VERIFIED_MOVED.format(d=d)})"


def _recreate_shards_update_trigger(columns: tuple[str, ...]) -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    op.execute(f"DROP TRIGGER IF EXISTS {TRIGGER}" + (" ON shards" if pg else ""))
    if pg:
        op.execute(f"CREATE CONSTRAINT TRIGGER {TRIGGER} AFTER UPDATE ON shards DEFERRABLE INITIALLY DEFERRED "
                   f"FOR EACH ROW WHEN ({_condition(columns, 'IS DISTINCT FROM')}) "
                   f"EXECUTE FUNCTION ckptd_resume_gen_shards()")
    else:
        run_ids = ("SELECT run_id FROM checkpoints WHERE id = OLD.checkpoint_id UNION "
                   "SELECT run_id FROM checkpoints WHERE id = NEW.checkpoint_id")
        body = (f"INSERT OR IGNORE INTO resume_generations (run_id, generation) SELECT run_id, 0 FROM ({run_ids}) "
                f"WHERE run_id IS NOT NULL; "
                f"UPDATE resume_generations SET generation = generation + 1 WHERE run_id IN ({run_ids});")
        op.execute(f"CREATE TRIGGER {TRIGGER} AFTER UPDATE ON shards FOR EACH ROW "
                   f"WHEN {_condition(columns, 'IS NOT')} BEGIN {body} END")


OLD_COLUMNS = ("checkpoint_id", "rank", "path")


def upgrade() -> None:
    op.create_table(
        'nodes',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(255), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('pid', sa.Integer(), nullable=True),
        sa.Column('root', sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('name'),
    )
    op.add_column('shards', sa.Column('node', sa.String(255), nullable=True))
    op.add_column('shards', sa.Column('claimed_by', sa.String(255), nullable=True))
    op.add_column('shards', sa.Column('facts', sa.Text(), nullable=True))
    op.add_column('shards', sa.Column('verified_config', sa.String(32), nullable=True))
    op.create_index('ix_shards_node', 'shards', ['node'])
    _recreate_shards_update_trigger(OLD_COLUMNS + ("node",))


def downgrade() -> None:
    _recreate_shards_update_trigger(OLD_COLUMNS)
    op.drop_index('ix_shards_node', table_name='shards')
    op.drop_column('shards', 'verified_config')
    op.drop_column('shards', 'facts')
    op.drop_column('shards', 'claimed_by')
    op.drop_column('shards', 'node')
    op.drop_table('nodes')
