"""Alembic environment: the engine comes from ckptd (``ckptd db upgrade``), never from a global ini."""

from __future__ import annotations

from alembic import context

from ckptd.catalog.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        from ckptd.catalog.db import make_engine

        engine = make_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as connection:
        # Several daemons may run `db upgrade` at once on PostgreSQL: serialize them.
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7426001)")
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `ckptd db upgrade --db URL`")
run_migrations_online()
