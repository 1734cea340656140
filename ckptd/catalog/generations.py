"""The resume generation counters (migration 0002) as the resume cache reads them: one point
lookup per question, in an ORM session or -- on the cache's hit path -- on a raw DB-API connection
of its own (no pool checkout; PostgreSQL lookups of many runs share one round trip)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

_ONE = "SELECT r.id, g.generation FROM runs r LEFT JOIN resume_generations g ON g.run_id = r.id WHERE r.name = {param}"
_MANY_PG = ("SELECT r.name, r.id, g.generation FROM runs r LEFT JOIN resume_generations g ON g.run_id = r.id "
            "WHERE r.name = ANY(%s)")


def of_run(s: Session, run_name: str) -> tuple[int, int] | None:
    """(run id, generation) of a run, None if there is no such run."""
    row = s.execute(text(_ONE.format(param=":name")), {"name": run_name}).first()
    return None if row is None else (row[0], row[1] or 0)


def open_connection(engine: Engine, remote: bool) -> Any:
    """A DB-API connection of the caller's own (detached from the pool) for lookups on the event loop."""
    pooled = engine.raw_connection()  # connect-time setup (SQLite pragmas) included
    conn = pooled.driver_connection
    pooled.detach()  # ours for good: not returned to (nor counted by) the engine's pool
    if remote:
        conn.autocommit = True  # every lookup sees the latest commit; never idle in transaction
        conn.execute("SET statement_timeout = '5s'")
    else:
        conn.execute("PRAGMA busy_timeout = 100")  # runs on the event loop: never wait long
    return conn


def lookup(conn: Any, run_name: str, remote: bool) -> tuple[int, int] | None:
    cur = conn.cursor()
    try:
        cur.execute(_ONE.format(param="%s" if remote else "?"), (run_name,))
        row = cur.fetchone()
    finally:
        cur.close()
    return None if row is None else (row[0], row[1] or 0)


def lookup_many(conn: Any, names: set[str]) -> dict[str, tuple[int, int]]:
    """PostgreSQL: every named run's (id, generation) in one round trip."""
    with conn.cursor() as cur:
        cur.execute(_MANY_PG, (sorted(names),))
        return {name: (run_id, gen or 0) for name, run_id, gen in cur.fetchall()}
