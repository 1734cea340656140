"""Catalog connections: SQLite (embedded default, WAL) or PostgreSQL (shared by several daemons).

Call order: ``make_engine(url)`` → ``upgrade(engine)`` (``ckptd db upgrade``) or
``require_current_schema(engine)`` (the daemon refuses to start otherwise) → ``Session(engine)``.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url

from ckptd.errors import CkptdError

DEFAULT_DB_PATH = os.path.join(os.path.expanduser("~"), ".local", "share", "ckptd", "catalog.db")


class CatalogError(CkptdError):
    code = "catalog"
    default_hint = "check the --db URL; run `ckptd db upgrade` to create or migrate the catalog"


class SchemaMismatchError(CatalogError):
    code = "schema"


def default_url() -> str:
    return f"sqlite:///{DEFAULT_DB_PATH}"


def make_engine(url: str | None = None) -> Engine:
    url = url or default_url()
    try:
        parsed = make_url(url)
    except Exception:  # sqlalchemy raises ArgumentError with a terse message
        raise CatalogError(f"not a database URL: {url!r}", hint="use sqlite:///PATH or postgresql+psycopg://HOST/DB") from None
    if parsed.get_backend_name() == "sqlite":
        db_path = parsed.database
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:  # noqa: ANN001 - DBAPI objects
            cur = dbapi_conn.cursor()
            # WAL: readers (API) never block the writer (ingest); NORMAL is durable enough with WAL.
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    if parsed.get_backend_name() == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        return create_engine(parsed, pool_pre_ping=True, pool_size=8, max_overflow=8)
    raise CatalogError(f"unsupported database {parsed.get_backend_name()!r}", hint="use SQLite or PostgreSQL")


def _migrations_dir() -> str:
    import ckptd.migrations as pkg

    return os.path.dirname(pkg.__file__)


def _alembic_config(engine: Engine):  # noqa: ANN202 - alembic type is optional at import time
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", _migrations_dir())
    cfg.attributes["engine"] = engine
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    cfg = _alembic_config(None)  # type: ignore[arg-type]
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    try:
        with engine.connect() as conn:
            if not inspect(conn).has_table("alembic_version"):
                return None
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except Exception as exc:  # connection refused, bad credentials...
        raise CatalogError(f"cannot connect to the catalog: {exc.__class__.__name__}: {exc}".splitlines()[0]) from None


def upgrade(engine: Engine, to: str = "head") -> tuple[str | None, str]:
    """Apply migrations up to ``to`` (head; an older revision only to test upgrades); returns (before, after)."""
    from alembic import command

    before = current_revision(engine)
    command.upgrade(_alembic_config(engine), to)
    return before, head_revision() if to == "head" else to


def require_current_schema(engine: Engine) -> None:
    """The daemon's start-up guard: refuse an un-migrated or newer-than-known catalog."""
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    from alembic.script import ScriptDirectory

    known = {rev.revision for rev in ScriptDirectory.from_config(_alembic_config(engine)).walk_revisions()}
    if current is None:
        raise SchemaMismatchError("the catalog has no ckptd schema yet", hint="run `ckptd db upgrade --db URL` first")
    if current not in known:
        raise SchemaMismatchError(
            f"the catalog schema {current} is newer than this ckptd knows (head {head})",
            hint="upgrade ckptd on this node; never run an older daemon against a newer catalog",
        )
    raise SchemaMismatchError(
        f"the catalog schema {current} is older than this ckptd's {head}", hint="run `ckptd db upgrade --db URL`"
    )
