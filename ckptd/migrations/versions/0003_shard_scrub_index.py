"""shard scrub index: find the verified shards whose last verification is oldest

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 03:05:00

The daemon's background scrub (``scrub_interval``) re-reads verified shards oldest-verified
first to catch bit rot that keeps size and mtime. Without this index each scrub pass would scan
every shard row (a million rows on a large catalog).
"""

from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


# Plain CREATE/DROP INDEX, not batch mode: a SQLite table rebuild would drop the resume-generation
# triggers of 0002.


def upgrade() -> None:
    op.create_index('ix_shards_state_verified_at', 'shards', ['state', 'verified_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_shards_state_verified_at', table_name='shards')
