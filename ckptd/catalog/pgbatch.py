"""Batches of rows as one parameter per column, so a statement's SQL text is the same for every
batch size.

PostgreSQL takes arrays (``unnest``, ``= ANY``): psycopg converts the text once and the server plans
it from its cache. A multi-row VALUES list of 512 shards is 6,000 parameters, converted by psycopg
(~30 ms) and parsed by the server anew for every statement: most of a burst's registration time.
SQLite has no arrays: IN lists, or a JSON array.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import any_, bindparam
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import InstrumentedAttribute, Session
from sqlalchemy.sql.elements import ColumnElement


def unnest_rows(types: dict[str, str]) -> str:
    """``unnest(CAST(:a AS t), …) AS v(a, …)``: rows that arrive as one array parameter per column."""
    return ("unnest(" + ", ".join(f"CAST(:{c} AS {t})" for c, t in types.items()) + ") AS v("
            + ", ".join(types) + ")")


def column_arrays(rows: list[dict[str, Any]], columns: dict[str, str]) -> dict[str, list[Any]]:
    """The parameters of :func:`unnest_rows`: one list per column, from rows as dicts."""
    return {c: [r[c] for r in rows] for c in columns}


def any_of(session: Session, column: InstrumentedAttribute, values: list[Any]) -> ColumnElement[bool]:
    """``column IN values`` for the verifier's batches. PostgreSQL: ``= ANY(<one array>)``, whose
    SQL text is the same for every batch size, so psycopg converts it once and the server plans it
    from its cache (a 128-item IN list is ~10 ms of psycopg query conversion per statement, more
    than the round trip). SQLite has no arrays: IN."""
    if session.get_bind().dialect.name == "postgresql":
        return column == any_(bindparam(None, list(values), type_=postgresql.ARRAY(column.type)))
    return column.in_(values)
