"""Verification claims and verdicts: the catalog side of ``ckptd.service.verifier``.

A verification claims its shards (bumping each one's sequence number), reads the files outside
any transaction, then stores each verdict iff the shard is still the file that was read and no
verification started after it. Several daemons on one shared root thereby verify each shard once,
and a stale result never overwrites a newer file's state. A batch's verdicts and events are one
statement each (see :mod:`ckptd.catalog.pgbatch`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, DateTime, Row, bindparam, insert, or_, select, text, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import TextClause

from ckptd.catalog.models import Shard, VerificationEvent
from ckptd.catalog.pgbatch import any_of, column_arrays, unnest_rows
from ckptd.catalog.repo import LOCAL, FileStat, Owner, add_event
from ckptd.states import ShardState

_EVENT_ARRAYS = {"shard_id": "integer[]", "outcome": "varchar[]", "detail": "text[]", "seconds": "float8[]"}
_PG_SHARD_EVENTS = text(
    "INSERT INTO verification_events (checkpoint_id, shard_id, at, kind, outcome, detail, seconds)"
    f" SELECT :checkpoint_id, v.shard_id, :at, 'shard', v.outcome, v.detail, v.seconds FROM {unnest_rows(_EVENT_ARRAYS)}"
).bindparams(bindparam("at", type_=DateTime(timezone=True)))


# --- what the verifier reads before and around its claims ----------------------------------------
# Batches of shard ids go through ``any_of``: one SQL text for every batch size (see pgbatch).


def shard_targets(session: Session, shard_ids: list[int]) -> list[Row]:
    """(id, path, checkpoint_id, digest, state) of the shards that still exist, to group a batch
    by checkpoint before claiming it."""
    return list(session.execute(select(Shard.id, Shard.path, Shard.checkpoint_id, Shard.digest, Shard.state)
                                .where(any_of(session, Shard.id, shard_ids))).all())


def shard_checkpoints(session: Session, shard_ids: list[int]) -> list[Row]:
    """(checkpoint_id, id) of the shards that still exist: the verifier's queue is keyed by checkpoint."""
    return list(session.execute(select(Shard.checkpoint_id, Shard.id).where(any_of(session, Shard.id, shard_ids))).all())


def verdict_states(session: Session, shard_ids: list[int]) -> list[Row]:
    """(id, state, verified_config, error_code, verified_at) of the shards: whether a queued ask
    was answered meanwhile (by another daemon on a shared root). Read under the checkpoint's lock
    by the caller, so an answer stored before it is seen. No ids: no statement."""
    if not shard_ids:
        return []
    return list(session.execute(
        select(Shard.id, Shard.state, Shard.verified_config, Shard.error_code, Shard.verified_at)
        .where(any_of(session, Shard.id, shard_ids))).all())


def live_shards(session: Session, shard_ids: list[int]) -> list[Shard]:
    """The shards among ``shard_ids`` not deleted yet, as ORM objects to mark deleted (the caller
    holds their checkpoint's lock; ``repo.mark_deleted``)."""
    return list(session.execute(
        select(Shard).where(Shard.id.in_(shard_ids), Shard.state != ShardState.DELETED.value)).scalars())


def verified_before(session: Session, prefix: str, cutoff: datetime, owner: Owner, limit: int) -> list[int]:
    """Ids of verified shards below ``prefix`` that ``owner`` owns, last verified before
    ``cutoff``, oldest first, at most ``limit`` (index ``ix_shards_state_verified_at``): the
    scrub's next re-verifications."""
    return list(session.execute(
        select(Shard.id)
        .where(Shard.state == ShardState.VERIFIED.value, Shard.verified_at < cutoff,
               Shard.path.startswith(prefix, autoescape=True), owner.owned_clause())
        .order_by(Shard.verified_at)
        .limit(limit)
    ).scalars())


# --- claims and verdicts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """A shard this node now verifies: its verification's sequence number, its node and rank."""

    seq: int
    node: str | None
    rank: int


def claim_verifications(session: Session, shard_ids: list[int], owner: Owner = LOCAL) -> dict[int, Claim]:
    """Start verifications: claim each shard for this node and bump its sequence number (see
    ``record_verifications``); returns the shards claimed. A shard another live node is verifying
    is not claimed (several daemons on one shared root verify each shard once); a claim of an
    unreachable node is taken over. Callers claim the shards of one checkpoint under its lock,
    which serializes claims the way ``SKIP LOCKED`` would. One statement: the rows it updated are
    exactly the claimed ones (a shard this node already claimed is claimed again)."""
    if not shard_ids:
        return {}
    free = or_(Shard.claimed_by.is_(None), Shard.claimed_by == owner.node, Shard.claimed_by.in_(sorted(owner.dead)))
    rows = session.connection().execute(
        update(Shard.__table__).where(any_of(session, Shard.id, shard_ids), free)
        .values(verify_seq=Shard.verify_seq + 1, claimed_by=owner.node)
        .returning(Shard.id, Shard.verify_seq, Shard.node, Shard.rank)).all()
    return {sid: Claim(seq, node, rank) for sid, seq, node, rank in rows}


def release_claims(session: Session, shard_ids: list[int], owner: Owner = LOCAL) -> None:
    if shard_ids:
        session.execute(update(Shard).where(any_of(session, Shard.id, shard_ids), Shard.claimed_by == owner.node)
                        .values(claimed_by=None))


def record_verification(
    session: Session, shard_id: int, st: FileStat, *, state: ShardState, values: dict[str, Any], detail: str | None,
    seconds: float, ckpt_id: int,
) -> bool:
    """Store one outcome found without a claim (ingest's parse error) iff the shard is still the
    file that was judged and belongs to a step (``ckpt_id``, the shard's checkpoint)."""
    cond = [
        Shard.id == shard_id,
        Shard.size == st.size,
        Shard.mtime_ns == st.mtime_ns,
        Shard.inode == st.inode,
        Shard.state.notin_((ShardState.DELETED.value, ShardState.SUPERSEDED.value)),  # not part of any step any more
    ]
    res = session.execute(
        update(Shard)
        .where(*cond)
        .values(state=state.value, verified_at=datetime.now(timezone.utc), quarantined=state == ShardState.CORRUPT,
                claimed_by=None, **values)
    )
    if res.rowcount:
        add_event(session, ckpt_id, shard_id, "shard", state.value, detail, seconds)
    return bool(res.rowcount)


@dataclass(frozen=True)
class Verdict:
    """One verification outcome to store (see ``record_verifications``)."""

    shard_id: int
    stat: FileStat  # the file as it was when read
    state: ShardState
    values: dict[str, Any]  # digest, format, encryption, crc, global_step, error_code, error
    seq: int | None
    seconds: float


#: ``facts``: the step check's facts the verification took from the same read (or null)
_VERDICT_COLUMNS = ("digest", "format", "encryption", "crc", "global_step", "error_code", "error", "verified_config",
                    "facts")
_VERDICT_FIELDS = ("id", "size", "mtime", "inode", "seq", "state", *_VERDICT_COLUMNS)
_PG_ARRAY_TYPES = dict.fromkeys(_VERDICT_FIELDS, "varchar[]") | {
    "id": "integer[]", "size": "bigint[]", "mtime": "bigint[]", "inode": "bigint[]", "seq": "integer[]",
    "global_step": "bigint[]", "error": "text[]", "facts": "text[]",
}


def _store_verdicts_sql(rows_source: str) -> TextClause:
    """One ``UPDATE … FROM <rows> AS v … RETURNING`` for a whole batch of verdicts: one round trip
    and constant SQL text (a VALUES list of N rows would be compiled anew for every batch size,
    which costs more than the round trips it saves). Only how the rows arrive differs by dialect."""
    return text(
        "UPDATE shards SET state = v.state, verified_at = :at, quarantined = (v.state = 'corrupt'), claimed_by = NULL, "
        + ", ".join(f"{c} = v.{c}" for c in _VERDICT_COLUMNS)
        + f" FROM {rows_source}"
        " WHERE shards.id = v.id AND shards.size = v.size AND shards.mtime_ns = v.mtime AND shards.inode = v.inode"
        " AND shards.state NOT IN ('deleted', 'superseded') AND (v.seq IS NULL OR shards.verify_seq = v.seq)"
        " RETURNING shards.id"
    ).bindparams(bindparam("at", type_=DateTime(timezone=True)))  # stored exactly as the ORM stores it


# PostgreSQL: one array per column; SQLite (no arrays): the rows as one JSON array
_PG_STORE_VERDICTS = _store_verdicts_sql(unnest_rows(_PG_ARRAY_TYPES))
_SQLITE_STORE_VERDICTS = _store_verdicts_sql(
    "(SELECT " + ", ".join(f"json_extract(value, '$[{i}]') AS {f}" for i, f in enumerate(_VERDICT_FIELDS))
    + " FROM json_each(:rows)) AS v"
)


def _store_verdicts(conn: Connection, verdicts: list[Verdict], now: datetime) -> set[int]:
    rows = [
        (v.shard_id, v.stat.size, v.stat.mtime_ns, v.stat.inode, v.seq, v.state.value,
         *(v.values.get(c) for c in _VERDICT_COLUMNS))
        for v in verdicts
    ]
    if conn.dialect.name == "postgresql":
        params: dict[str, Any] = dict(zip(_VERDICT_FIELDS, map(list, zip(*rows, strict=True)), strict=True))
        return set(conn.execute(_PG_STORE_VERDICTS, params | {"at": now}).scalars())
    return set(conn.execute(_SQLITE_STORE_VERDICTS, {"rows": json.dumps(rows), "at": now}).scalars())


def record_verifications(session: Session, ckpt_id: int, verdicts: list[Verdict]) -> set[int]:
    """Store verification outcomes of one checkpoint's shards (caller holds its lock); each is
    written iff the shard is still the file that was verified and no verification started after
    this one (``seq`` from ``claim_verifications``). Returns the ids whose verdict was stored.

    Core statements on the session's connection: the ORM's per-statement bookkeeping (autoflush,
    session synchronisation) cost 5 ms a shard, more than reading a small shard."""
    conn = session.connection()
    now = datetime.now(timezone.utc)
    if not verdicts:
        return set()
    stored = _store_verdicts(conn, verdicts, now)
    events = [
        {"checkpoint_id": ckpt_id, "shard_id": v.shard_id, "at": now, "kind": "shard", "outcome": v.state.value,
         "detail": v.values.get("error"), "seconds": v.seconds}
        for v in verdicts if v.shard_id in stored
    ]
    if events and conn.dialect.name == "postgresql":
        conn.execute(_PG_SHARD_EVENTS, {"checkpoint_id": ckpt_id, "at": now} | column_arrays(events, _EVENT_ARRAYS))
    elif events:
        conn.execute(insert(VerificationEvent.__table__), events)
    return stored
