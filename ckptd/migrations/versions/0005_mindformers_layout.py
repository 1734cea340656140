"""MindFormers layout: a run's layout, a step's incarnation and health verdict

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 09:40:00

* ``runs.layout``: ``native`` (``<run>/rank_<r>/``) or ``mindformers`` (``<run>/checkpoint/rank_<r>/``,
  per-rank strategy files); decided from the paths ckptd sees (``ckptd.runlayout``). NULL on rows
  from before this revision: they were all native.
* ``checkpoints.incarnation``: which restart of the job wrote the step (MindSpore's ``_k`` prefix
  suffix after the rank tag); NULL when the names do not say.
* ``checkpoints.health_reason``: why the job's own health record (MindFormers'
  ``health_ckpts.json``) calls the step abnormal; the resume oracle skips such steps.
* ``checkpoints.load_plan``: for a step whole only as the union of its files (remove_redundancy,
  dying-gasp saves), JSON ``{rank: [ranks whose files hold its slices]}``.

Both checkpoint columns can change a resume answer, so the checkpoints UPDATE trigger of 0002 is
re-created with them in its column list.
"""

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

# 0002's list, frozen here (a migration never imports another), plus this revision's columns
OLD_COLUMNS = ("run_id", "prefix", "epoch", "step", "kind", "layout", "global_step", "state", "expected_ranks",
               "strategy_id", "step_checks_ok", "reason", "derived_from_id", "pinned", "marked_bad", "bad_reason")
NEW_COLUMNS = OLD_COLUMNS + ("incarnation", "health_reason", "load_plan")
TRIGGER = "ckptd_resume_gen_checkpoints_update"


def _changed(columns: tuple[str, ...], distinct: str) -> str:
    return " OR ".join(f"OLD.{c} {distinct} NEW.{c}" for c in columns)


def _recreate_checkpoint_update_trigger(columns: tuple[str, ...]) -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    name = TRIGGER
    op.execute(f"DROP TRIGGER IF EXISTS {name}" + (" ON checkpoints" if pg else ""))
    if pg:
        cond = _changed(columns, "IS DISTINCT FROM")
        op.execute(f"CREATE CONSTRAINT TRIGGER {name} AFTER UPDATE ON checkpoints DEFERRABLE INITIALLY DEFERRED "
                   f"FOR EACH ROW WHEN ({cond}) EXECUTE FUNCTION ckptd_resume_gen_checkpoints()")
    else:
        run_ids = "SELECT OLD.run_id AS run_id UNION SELECT NEW.run_id AS run_id"
        body = (f"INSERT OR IGNORE INTO resume_generations (run_id, generation) SELECT run_id, 0 FROM ({run_ids}) "
                f"WHERE run_id IS NOT NULL; "
                f"UPDATE resume_generations SET generation = generation + 1 WHERE run_id IN ({run_ids});")
        op.execute(f"CREATE TRIGGER {name} AFTER UPDATE ON checkpoints FOR EACH ROW "
                   f"WHEN {_changed(columns, 'IS NOT')} BEGIN {body} END")


# Plain ADD/DROP COLUMN, not batch mode: a SQLite table rebuild would drop the triggers of 0002.


def upgrade() -> None:
    op.add_column('runs', sa.Column('layout', sa.String(16), nullable=True))
    op.add_column('checkpoints', sa.Column('incarnation', sa.Integer(), nullable=True))
    op.add_column('checkpoints', sa.Column('health_reason', sa.Text(), nullable=True))
    op.add_column('checkpoints', sa.Column('load_plan', sa.Text(), nullable=True))
    _recreate_checkpoint_update_trigger(NEW_COLUMNS)


def downgrade() -> None:
    _recreate_checkpoint_update_trigger(OLD_COLUMNS)
    op.drop_column('checkpoints', 'load_plan')
    op.drop_column('checkpoints', 'health_reason')
    op.drop_column('checkpoints', 'incarnation')
    op.drop_column('runs', 'layout')
