"""strategy file mtime: when a layout appeared, on the trainer's filesystem clock

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 06:00:00

A job restarted on another parallel layout re-saves steps the old layout had saved. ckptd tells
the re-saved shards from the old layout's leftovers by comparing each shard file's mtime with the
mtime the strategy file had when ckptd first saw its new content (see ``ckptd.states``). Both come
from the same filesystem, so it also works when the daemon was down during the change. Rows from
before this revision have NULL and fall back to ``seen_at``.

The new shard / step state ``superseded`` needs no schema change (states are strings).
"""

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


# Plain ADD/DROP COLUMN, not batch mode: a SQLite table rebuild would drop the resume-generation
# triggers of 0002 (strategy_files has two of them).


def upgrade() -> None:
    op.add_column('strategy_files', sa.Column('mtime_ns', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column('strategy_files', 'mtime_ns')
