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
