"""Catalog connections: SQLite (embedded default, WAL) or PostgreSQL (shared by several daemons).

Call order: ``make_engine(url)`` → ``upgrade(engine)`` (``ckptd db upgrade``) or
``require_current_schema(engine)`` (the daemon refuses to start otherwise) → ``Session(engine)``.
``probe(engine)`` says whether the catalog takes writes now (``/healthz``); ``catalog_problem(err)``
reads a database error as the catalog's state (the API answers those 503).
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event, exc as sa_exc, inspect, text
from sqlalchemy.engine import make_url

from ckptd.configfile import default_db_url
from ckptd.errors import CkptdError



class CatalogError(CkptdError):
    code = "catalog"
    default_hint = "check the --db URL; run `ckptd db upgrade` to create or migrate the catalog"


class SchemaMismatchError(CatalogError):
    code = "schema"


def make_engine(url: str | None = None) -> Engine:
    url = url or default_db_url()
    try:
        parsed = make_url(url)
    except Exception:  # sqlalchemy raises ArgumentError with a terse message
        raise CatalogError(f"not a database URL: {url!r}", hint="use sqlite:///PATH or postgresql+psycopg://HOST/DB") from None
    if parsed.get_backend_name() == "sqlite":
        db_path = parsed.database
        plain_file = bool(db_path) and db_path != ":memory:" and not db_path.startswith("file:") and not parsed.query
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        if plain_file:
            engine = create_engine(url, creator=_sqlite_creator(os.path.abspath(db_path)))
            _guard_sqlite_file(engine, os.path.abspath(db_path))
        else:
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


def _file_identity(path: str) -> tuple[int, int, bool] | None:
    """(device, inode, writable by this process) of the catalog file, None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, os.access(path, os.W_OK)


def _sqlite_creator(path: str):  # noqa: ANN202 - a DBAPI connection factory
    """Connections to the catalog file. Only the first may create it (``ckptd db upgrade`` on a
    new path): once it existed, a deleted catalog must be an error, not a new empty file that
    half of the pool writes to while the other half writes to the deleted one."""
    uri = f"file:{quote(path)}"
    opened = [False]

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(f"{uri}?mode={'rw' if opened[0] else 'rwc'}", uri=True, timeout=30,
                               check_same_thread=False)
        opened[0] = True
        return conn

    return connect


def _guard_sqlite_file(engine: Engine, path: str) -> None:
    """A pooled SQLite connection keeps the file it opened: after ``rm catalog.db`` its writes
    land in the deleted inode and are lost without an error, and after ``chmod 0444`` (or the
    immutable flag) it writes on. So a connection is used only while the path still names the
    file it opened, as writable as it was: otherwise it is discarded and a new one opened (which
    fails for a missing file, and takes no writes for one this process may not write, so writes
    get a clear error)."""

    @event.listens_for(engine, "connect")
    def _remember(dbapi_conn, record) -> None:  # noqa: ANN001 - DBAPI objects
        identity = record.info["ckptd_file"] = _file_identity(path)
        if identity is not None and not identity[2]:
            # SQLite may hand a new connection a read-write descriptor another connection left
            # open on the same inode, and write through it: refuse writes here instead
            dbapi_conn.execute("PRAGMA query_only = ON")

    @event.listens_for(engine, "checkout")
    def _still_the_same_file(_dbapi_conn, record, _proxy) -> None:  # noqa: ANN001
        if _file_identity(path) != record.info.get("ckptd_file"):
            raise sa_exc.DisconnectionError("the catalog file was deleted, replaced or changed its permissions")


#: SQLite result codes (``sqlite_errorname``) and PostgreSQL SQLSTATEs that mean the catalog cannot
#: serve the request now -- the operator's problem, never the request's or a bug
_SQLITE_PROBLEMS = {
    "SQLITE_READONLY": "the catalog is read-only", "SQLITE_CANTOPEN": "the catalog file is gone or cannot be opened",
    "SQLITE_BUSY": "the catalog is locked by another writer", "SQLITE_LOCKED": "the catalog is locked by another writer",
    "SQLITE_FULL": "the catalog's disk is full", "SQLITE_IOERR": "the catalog's disk failed (I/O error)",
    "SQLITE_CORRUPT": "the catalog file is damaged", "SQLITE_NOTADB": "the catalog file is not a database",
    "SQLITE_PERM": "the catalog file may not be written",
}


def catalog_problem(err: BaseException) -> str | None:
    """What a database error says about the catalog, in words (never SQL): None when it is not
    the catalog's state (a constraint, a bug). The one reading of such errors, for ``/healthz``
    and the API's 503 answers."""
    orig = getattr(err, "orig", err)
    if isinstance(orig, sqlite3.Error):
        name = getattr(orig, "sqlite_errorname", "") or ""
        for prefix, words in _SQLITE_PROBLEMS.items():
            if name.startswith(prefix):
                return words
        if "no such table" in str(orig):
            return "the catalog file has no ckptd schema (was it replaced?)"
        return "the catalog cannot be used" if isinstance(orig, sqlite3.OperationalError) else None
    sqlstate = getattr(orig, "sqlstate", None) or ""
    if sqlstate == "25006":
        return "the catalog is read-only (a read-only database or a standby server)"
    if sqlstate.startswith(("08", "57P")) or sqlstate == "53300":
        return "the catalog server is unreachable or shutting down"
    if sqlstate.startswith("53"):
        return "the catalog server is out of resources (disk, memory or connections)"
    if isinstance(err, (sa_exc.OperationalError, sa_exc.DisconnectionError)) or \
            (isinstance(err, sa_exc.DBAPIError) and err.connection_invalidated):
        return "the catalog server is unreachable"
    return None


def probe(engine: Engine) -> str | None:
    """Why the catalog cannot take writes now, or None. A real check: it reads the schema version
    and starts a write (an UPDATE of no row, rolled back) on a connection as the daemon's requests
    get one, so a deleted, replaced, read-only or unreachable catalog is seen as such."""
    try:
        with engine.connect() as conn:
            if conn.execute(text("SELECT version_num FROM alembic_version")).scalar() is None:
                return "the catalog has no schema version"
            conn.execute(text("UPDATE alembic_version SET version_num = version_num WHERE 1 = 0"))
            conn.rollback()
    except sa_exc.SQLAlchemyError as err:
        problem = catalog_problem(err)
        if problem is None:
            raise
        return problem
    return None


def _migrations_dir() -> str:
    import ckptd.migrations as pkg

    return os.path.dirname(pkg.__file__)


def _alembic_config(engine: Engine):  # noqa: ANN202 - alembic type is optional at import time
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", _migrations_dir())
    cfg.attributes["engine"] = engine
    return cfg


_REVISION = re.compile(r"^revision\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", re.M)
_DOWN = re.compile(r"^down_revision\s*(?::[^=]*)?=\s*(?:['\"]([^'\"]+)['\"]|None)", re.M)


def quick_head() -> str | None:
    """The head revision read from the migration files' ``revision = '...'`` and ``down_revision``
    lines, without importing alembic and every migration (~0.1 s of a CLI command's start-up);
    None when the files do not say it plainly (one linear history), and callers ask alembic."""
    versions = os.path.join(_migrations_dir(), "versions")
    revisions, parents = set(), set()
    try:
        names = [n for n in os.listdir(versions) if n.endswith(".py") and not n.startswith("_")]
        for name in names:
            with open(os.path.join(versions, name), encoding="utf-8") as fh:
                body = fh.read()
            rev, down = _REVISION.findall(body), _DOWN.findall(body)
            if len(rev) != 1 or len(down) != 1:
                return None
            revisions.add(rev[0])
            parents.add(down[0])
    except OSError:
        return None
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 and len(revisions) == len(names) else None


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
    current = current_revision(engine)
    if current is not None and current == quick_head():
        return  # the usual answer, without alembic; anything else is explained by alembic below
    head = head_revision()
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
