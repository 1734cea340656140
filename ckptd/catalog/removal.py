"""Retention's catalog rows (``ckptd.service.retention`` decides; this reads, locks and deletes).

Lock order (docs/ARCHITECTURE.md, *Concurrency rules*): steps are locked in id order, each step
before its history rows and before any of its shard rows.
"""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from ckptd.catalog import copies, repo
from ckptd.catalog.models import Checkpoint, ConversionJob, Run, Shard, VerificationEvent
from ckptd.states import ShardState, StepState


def conversion_source_ids(s: Session) -> set[int]:
    """Steps a queued or running conversion reads."""
    return set(s.execute(
        select(ConversionJob.source_checkpoint_id).where(ConversionJob.state.in_(("queued", "running")))).scalars())


def runs(s: Session, run_name: str | None = None) -> list[Run]:
    """Every run by name (or only ``run_name``'s)."""
    q = select(Run).order_by(Run.name)
    if run_name is not None:
        q = q.where(Run.name == run_name)
    return list(s.execute(q).scalars())


def run_paths(s: Session, run_name: str | None = None) -> list[str]:
    q = select(Run.path)
    if run_name is not None:
        q = q.where(Run.name == run_name)
    return list(s.execute(q).scalars())


def lock_steps(s: Session, ids: list[int]) -> list[Checkpoint]:
    """The steps ``ids``, locked in id order until commit."""
    return list(s.execute(repo.for_update(select(Checkpoint).where(Checkpoint.id.in_(ids)).order_by(Checkpoint.id),
                                          s)).scalars())


def copies_of(s: Session, ckpt_id: int) -> list[Checkpoint]:
    """The converted copies derived from step ``ckpt_id``."""
    return list(s.execute(select(Checkpoint).where(Checkpoint.derived_from_id == ckpt_id)).scalars())


def all_shard_paths(s: Session, ckpt_id: int) -> list[str]:
    """Every shard row's path of a checkpoint, whatever its state."""
    return list(s.execute(select(Shard.path).where(Shard.checkpoint_id == ckpt_id)).scalars())


def delete_conversions_writing(s: Session, copy_id: int) -> None:
    s.execute(ConversionJob.__table__.delete().where(ConversionJob.output_checkpoint_id == copy_id))


def delete_conversions_reading(s: Session, ckpt_id: int) -> None:
    s.execute(ConversionJob.__table__.delete().where(ConversionJob.source_checkpoint_id == ckpt_id))


def delete_checkpoint_rows(s: Session, ckpt_id: int) -> None:
    """A checkpoint's rows and everything that points at them (events, shards)."""
    shard_ids = s.execute(select(Shard.id).where(Shard.checkpoint_id == ckpt_id)).scalars().all()
    s.execute(delete(VerificationEvent).where(
        (VerificationEvent.checkpoint_id == ckpt_id) | VerificationEvent.shard_id.in_(shard_ids)))
    copies.delete_of_step(s, ckpt_id)
    s.execute(delete(Shard).where(Shard.checkpoint_id == ckpt_id))
    s.execute(delete(Checkpoint).where(Checkpoint.id == ckpt_id))


def deleting_step_ids(s: Session) -> list[int]:
    return list(s.execute(select(Checkpoint.id).where(Checkpoint.state == StepState.DELETING.value)).scalars())


def shard_rows(s: Session, ckpt_id: int) -> list[tuple[int, str, str | None, str]]:
    """(id, path, node, state) of every shard row of a checkpoint."""
    return [tuple(r) for r in s.execute(select(Shard.id, Shard.path, Shard.node, Shard.state).where(
        Shard.checkpoint_id == ckpt_id))]


def mark_shards_deleted(s: Session, shard_ids: list[int]) -> None:
    s.execute(update(Shard).where(Shard.id.in_(shard_ids)).values(state=ShardState.DELETED.value))


def nodes_still_holding(s: Session, ckpt_id: int) -> list[str | None]:
    """The node of each shard row of the checkpoint not deleted yet."""
    return list(s.execute(select(Shard.node).where(
        Shard.checkpoint_id == ckpt_id, Shard.state != ShardState.DELETED.value)).scalars())


def set_reason(s: Session, ckpt_id: int, reason: str) -> None:
    s.execute(update(Checkpoint).where(Checkpoint.id == ckpt_id).values(reason=reason))
