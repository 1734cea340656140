"""numbers from file names fit: 64-bit epochs and incarnations; incarnations of plain jobs filled in

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 09:00:00

Issue 26: ``llama-2147483648_5.ckpt`` is a name MindSpore writes, but its epoch did not fit the
32-bit ``checkpoints.epoch`` on PostgreSQL; the insert failed and took the whole rescan with it.

* ``checkpoints.epoch`` and ``checkpoints.incarnation`` become BIGINT on PostgreSQL, like ``step``.
  Every number ckptd reads off a name is range-checked before it reaches the catalog
  (``ckptd.runnames``: epochs and steps up to 2**63 - 1, ranks and restart suffixes up to 2**20),
  so whatever passes fits. SQLite's INTEGER already holds 64 bits; its declared types stay (a
  table rebuild there would drop the triggers of 0002), which the models say (``WideInteger``).
  The checkpoints UPDATE trigger names both columns in its WHEN clause, and PostgreSQL refuses to
  retype a column a trigger definition uses: it is dropped and re-created around the change.
* Issue 25: ``incarnation`` was NULL for every step of a plain (native) job: only MindFormers'
  rank-tagged names were read. Trained steps of native runs whose incarnation is NULL get it from
  their prefix, by ckptd's one rule (``ckptd.runnames.prefix_incarnation``; NULL stays for a
  prefix holding another rank's tag). Breakpoint saves keep NULL (their ``_n`` is no restart).

Downgrade: refused while a value beyond 32 bits is stored (it would not fit); filled-in
incarnations are kept (0006's schema holds them).
"""

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

# the checkpoints UPDATE trigger as 0005 left it (frozen here: a migration never imports another)
COLUMNS = ("run_id", "prefix", "epoch", "step", "kind", "layout", "global_step", "state", "expected_ranks",
           "strategy_id", "step_checks_ok", "reason", "derived_from_id", "pinned", "marked_bad", "bad_reason",
           "incarnation", "health_reason", "load_plan")
TRIGGER = "ckptd_resume_gen_checkpoints_update"
WIDENED = ("epoch", "incarnation")
INT32_MAX = 2**31 - 1


def _retype(to: str) -> None:
    """PostgreSQL: ``WIDENED`` to ``to``, the trigger that names them dropped meanwhile."""
    changed = " OR ".join(f"OLD.{c} IS DISTINCT FROM NEW.{c}" for c in COLUMNS)
    op.execute(f"DROP TRIGGER IF EXISTS {TRIGGER} ON checkpoints")
    op.execute("ALTER TABLE checkpoints " + ", ".join(f"ALTER COLUMN {c} TYPE {to}" for c in WIDENED))
    op.execute(f"CREATE CONSTRAINT TRIGGER {TRIGGER} AFTER UPDATE ON checkpoints DEFERRABLE INITIALLY DEFERRED "
               f"FOR EACH ROW WHEN ({changed}) EXECUTE FUNCTION ckptd_resume_gen_checkpoints()")


def _fill_native_incarnations() -> None:
    from ckptd.runnames import prefix_incarnation  # the rule ingest applies to new files

    bind = op.get_bind()
    rows = bind.execute(sa.text(
        "SELECT c.id, c.prefix FROM checkpoints c JOIN runs r ON r.id = c.run_id WHERE c.kind = 'trained' "
        "AND c.incarnation IS NULL AND (r.layout IS NULL OR r.layout = 'native')")).all()
    for ckpt_id, prefix in rows:
        incarnation = prefix_incarnation(prefix)
        if incarnation is not None:
            bind.execute(sa.text("UPDATE checkpoints SET incarnation = :k WHERE id = :id"), {"k": incarnation, "id": ckpt_id})


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _retype("BIGINT")
    _fill_native_incarnations()


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return  # nothing was retyped
    wide = bind.execute(sa.text(
        f"SELECT count(*) FROM checkpoints WHERE epoch > {INT32_MAX} OR incarnation > {INT32_MAX}")).scalar()
    if wide:
        from ckptd.catalog.db import CatalogError

        raise CatalogError(f"cannot downgrade below 0007: {wide} checkpoint row(s) hold an epoch or incarnation "
                           f"beyond {INT32_MAX}, which 0006's 32-bit columns cannot store",
                           hint="delete those steps first, or stay on this revision")
    _retype("INTEGER")
