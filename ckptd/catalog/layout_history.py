"""Catalog writes for layout changes: a step re-saved under a newer strategy (rule in
:mod:`ckptd.states`, ``layout_resave``) is re-bound, and the shards its old layout left move to a
history row of the step (``kind = 'superseded'``).

Lock order, as everywhere: a step, then its history rows, then shard rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from ckptd.catalog.models import Checkpoint, Shard, StrategyFile, VerificationEvent
from ckptd.catalog.repo import insert_ignore, add_event, for_update, history_rows
from ckptd.states import RESAVABLE_KINDS, SUPERSEDED_KIND, Resave, ShardState, StepState, layout_resave

log = logging.getLogger("ckptd.ingest")


@dataclass(frozen=True)
class StrategyRow:
    """A strategy file row without its content (what layout-change decisions need)."""

    id: int
    path: str
    content_hash: str
    world_size: int
    valid: bool
    appeared_ns: int  # the file's mtime when this content was (last) first seen; seen_at for old rows


def appeared_ns(mtime_ns: int | None, seen_at: datetime) -> int:
    """When a strategy content appeared: the file's mtime then, or for rows from before migration
    0004 ckptd's clock when it was first seen (the best there is)."""
    if mtime_ns is not None:
        return mtime_ns
    seen = seen_at if seen_at.tzinfo else seen_at.replace(tzinfo=timezone.utc)
    return int(seen.timestamp() * 1e9)


def strategy_rows(session: Session, run_id: int) -> dict[str, list[StrategyRow]]:
    """A run's strategy rows by path, newest first: ``[0]`` is what the file holds now."""
    rows = session.execute(
        select(StrategyFile.id, StrategyFile.path, StrategyFile.content_hash, StrategyFile.world_size,
               StrategyFile.error, StrategyFile.mtime_ns, StrategyFile.seen_at)
        .where(StrategyFile.run_id == run_id)
        .order_by(StrategyFile.path, StrategyFile.seen_at.desc(), StrategyFile.id.desc())
    ).all()
    out: dict[str, list[StrategyRow]] = {}
    for sid, path, digest, world, error, mtime_ns, seen_at in rows:
        out.setdefault(path, []).append(StrategyRow(sid, path, digest, world, error is None, appeared_ns(mtime_ns, seen_at)))
    return out


def rebind_resaved_step(
    session: Session, ckpt: Checkpoint, old: StrategyRow, new: StrategyRow, stale: list[int]
) -> None:
    """Bind a step re-saved under ``new`` to it and move its shards written under ``old`` (ids
    ``stale``) to the step's history row as ``superseded`` (caller holds ``ckpt``'s lock; the
    history row is locked after it — the one lock order: the step, then its history)."""
    reason = f"saved under strategy {old.content_hash}; step re-saved under {new.content_hash}"
    if stale:
        history = _history_row(session, ckpt, old, reason)
        # deleted rows move too (their file is gone either way) but keep saying so
        session.execute(update(Shard).where(Shard.id.in_(stale), Shard.state != ShardState.DELETED.value).values(
            checkpoint_id=history.id, state=ShardState.SUPERSEDED.value, error_code="superseded", error=reason,
            verify_seq=Shard.verify_seq + 1))  # a verification of it in flight can no longer store
        session.execute(update(Shard).where(Shard.id.in_(stale)).values(checkpoint_id=history.id))
        session.add_all([VerificationEvent(checkpoint_id=history.id, shard_id=sid, kind="layout", outcome="superseded",
                                           detail=reason) for sid in stale])
    ckpt.strategy_id, ckpt.expected_ranks = new.id, new.world_size
    ckpt.step_checks_ok = ckpt.reason = ckpt.global_step = None  # checked again, under the new layout
    add_event(session, ckpt.id, None, "layout", "rebound",
              f"step re-saved under strategy {new.content_hash} (world {new.world_size}), was {old.content_hash} "
              f"(world {old.world_size}); {len(stale)} shard(s) of the old layout superseded")


def _history_row(session: Session, ckpt: Checkpoint, old: StrategyRow, reason: str) -> Checkpoint:
    now = datetime.now(timezone.utc)
    key = {"run_id": ckpt.run_id, "prefix": ckpt.prefix, "epoch": ckpt.epoch, "step": ckpt.step,
           "kind": SUPERSEDED_KIND, "layout": old.content_hash}
    insert_ignore(session, Checkpoint, key | {
        "state": StepState.SUPERSEDED.value, "expected_ranks": old.world_size, "strategy_id": old.id,
        "global_step": ckpt.global_step, "reason": reason, "pinned": False, "marked_bad": False,
        "created_at": now, "updated_at": now,
    }, list(key))
    q = select(Checkpoint).where(*(Checkpoint.__table__.c[k] == v for k, v in key.items()))  # column names
    return session.execute(for_update(q, session)).scalar_one()


def drop_empty_history(session: Session, ckpt: Checkpoint, history_ids: set[int]) -> None:
    """History rows of ``ckpt`` left without shards (each was rewritten and is the step's again)
    go; their events move to the step, so the story of each shard stays in one place."""
    for row in history_rows(session, ckpt):
        if row.id not in history_ids:
            continue
        if session.execute(select(Shard.id).where(Shard.checkpoint_id == row.id).limit(1)).first() is not None:
            continue
        session.execute(update(VerificationEvent).where(VerificationEvent.checkpoint_id == row.id)
                        .values(checkpoint_id=ckpt.id))
        session.execute(delete(Checkpoint).where(Checkpoint.id == row.id))


def follow_layout_change(s: Session, ckpt: Checkpoint) -> Resave | None:
    """Re-bind ``ckpt`` (locked) if it was re-saved under the layout its strategy file holds
    now, superseding its shards of the old layout (``states.layout_resave``). The re-save if
    it did, else None."""
    if ckpt.kind not in RESAVABLE_KINDS or ckpt.strategy_id is None or ckpt.state == StepState.DELETING.value:
        return None
    rows = strategy_rows(s, ckpt.run_id)
    bound = next((r for at_path in rows.values() for r in at_path if r.id == ckpt.strategy_id), None)
    if bound is None:
        return None
    now = rows[bound.path][0]  # what the file the step was saved with holds now
    if not now.valid:
        return None  # a file that does not parse says nothing about the layout
    shards = {sid: (rank, mtime) for sid, rank, mtime in s.execute(
        select(Shard.id, Shard.rank, Shard.mtime_ns).where(Shard.checkpoint_id == ckpt.id)).all()}
    resave = layout_resave(bound.content_hash, now.content_hash, now.world_size, now.appeared_ns, shards)
    if resave is None:
        return None
    rebind_resaved_step(s, ckpt, bound, now, sorted(resave.superseded))
    log.info("run %d step %d was re-saved under strategy %s: re-bound, %d shard(s) of %s superseded",
             ckpt.run_id, ckpt.step, now.content_hash[:19], len(resave.superseded), bound.content_hash[:19])
    return resave
