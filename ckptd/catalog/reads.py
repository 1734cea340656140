"""The catalog's read models: the queries behind the API's and the CLI's listings, ``/metrics``
and training health (with its one write, an operator clearing records, next to its reads).
Plain rows out (ORM objects or tuples); what they mean to people — dicts,
names, 404s — is decided by the callers (``ckptd.service.catalog``, ``ckptd.api``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, func, or_, select
from sqlalchemy.orm import Session

from ckptd.catalog.models import Checkpoint, Run, Shard, StepHealth, StrategyFile
from ckptd.states import ShardState, StepState


def run_named(s: Session, name: str) -> Run | None:
    return s.execute(select(Run).where(Run.name == name)).scalar_one_or_none()


def runs(s: Session) -> list[Run]:
    return list(s.execute(select(Run).order_by(Run.name)).scalars())


def steps_at(s: Session, run_id: int, step: int, kind: str) -> list[Checkpoint]:
    """The run's checkpoints of ``kind`` at ``step``: the global step their files record, or —
    not verified yet — the step in their file names; best match first (a known global step, then
    the newest epoch and incarnation)."""
    return list(s.execute(
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id, Checkpoint.kind == kind,
               or_(Checkpoint.global_step == step, and_(Checkpoint.global_step.is_(None), Checkpoint.step == step)))
        .order_by(Checkpoint.global_step.is_(None), Checkpoint.epoch.desc(), Checkpoint.incarnation.desc())
    ).scalars())


def step_state_counts(s: Session, run_id: int) -> dict[str, int]:
    return dict(s.execute(select(Checkpoint.state, func.count()).where(Checkpoint.run_id == run_id)
                          .group_by(Checkpoint.state)).all())


def latest_verified_step(s: Session, run_id: int) -> tuple[int | None, int, int, datetime] | None:
    """(global step -- the step's own or its verified shards', epoch, file-name step, created_at:
    when it was first seen saved, which no lease renewal or re-verification moves) of
    the run's newest restorable trained step: verified, not marked bad, no health reason (what the
    resume policy skips without the training's health reports), in the resume oracle's order
    (epoch, file-name step, incarnation: ``policy.StepInfo.position``)."""
    row = s.execute(
        select(shards_step_column(), Checkpoint.epoch, Checkpoint.step, Checkpoint.created_at)
        .where(Checkpoint.run_id == run_id, Checkpoint.state == StepState.VERIFIED.value, Checkpoint.kind == "trained",
               Checkpoint.marked_bad.is_(False), Checkpoint.health_reason.is_(None))
        .order_by(Checkpoint.epoch.desc(), Checkpoint.step.desc(), func.coalesce(Checkpoint.incarnation, 0).desc())
        .limit(1)
    ).first()
    return (row[0], row[1], row[2], row[3]) if row else None


def unverified_shard_nodes(s: Session, ckpt_ids: list[int]) -> dict[int, set[str | None]]:
    """The nodes holding each step's shards still awaiting a verdict (neither verified nor gone)."""
    out: dict[int, set[str | None]] = {}
    if not ckpt_ids:
        return out
    for ckpt_id, node in s.execute(select(Shard.checkpoint_id, Shard.node).where(
            Shard.checkpoint_id.in_(ckpt_ids), Shard.state.notin_((ShardState.VERIFIED.value, ShardState.DELETED.value,
                                                                   ShardState.SUPERSEDED.value))).distinct()).all():
        out.setdefault(ckpt_id, set()).add(node)
    return out


def live_shards_per_node(s: Session, run_id: int) -> dict[str | None, int]:
    return dict(s.execute(select(Shard.node, func.count()).join(Checkpoint, Shard.checkpoint_id == Checkpoint.id).where(
        Checkpoint.run_id == run_id, Shard.state != ShardState.DELETED.value).group_by(Shard.node)).all())


def shards_step_column():  # noqa: ANN201 - a SQLAlchemy column expression
    """A step's global step, or for a step not checked as a whole yet (a torn save's surviving
    shards) the one its verified shards hold: the subquery runs only where the step's own is NULL
    (COALESCE evaluates lazily on SQLite and PostgreSQL)."""
    return func.coalesce(Checkpoint.global_step, select(func.max(Shard.global_step)).where(
        Shard.checkpoint_id == Checkpoint.id, Shard.state == ShardState.VERIFIED.value).scalar_subquery())


def steps_with_shards_step(s: Session, run_id: int, state: str | None, limit: int) -> list[tuple[Checkpoint, int | None]]:
    """The run's steps (of ``state`` if given), newest first, each with :func:`shards_step_column`."""
    q = select(Checkpoint, shards_step_column()).where(Checkpoint.run_id == run_id)
    if state:
        q = q.where(Checkpoint.state == state)
    return [(c, seen) for c, seen in s.execute(q.order_by(Checkpoint.epoch.desc(), Checkpoint.step.desc()).limit(limit))]


def shards_of(s: Session, ckpt_id: int) -> list[Shard]:
    return list(s.execute(select(Shard).where(Shard.checkpoint_id == ckpt_id)).scalars())


def strategy_paths(s: Session, ids: set[int | None]) -> dict[int, str]:
    ids = {i for i in ids if i}
    if not ids:
        return {}
    return dict(s.execute(select(StrategyFile.id, StrategyFile.path).where(StrategyFile.id.in_(ids))).all())


# --- /metrics ----------------------------------------------------------------------------------


def shard_state_counts(s: Session) -> dict[str, int]:
    return dict(s.execute(select(Shard.state, func.count()).group_by(Shard.state)).all())


# --- training health ---------------------------------------------------------------------------


def health_row(s: Session, run_id: int, step: int) -> StepHealth:
    return s.execute(select(StepHealth).where(StepHealth.run_id == run_id, StepHealth.step == step)).scalar_one()


def health_values(s: Session, run_id: int) -> list[tuple[Any, ...]]:
    """Every reported step's stored (step, loss, loss_nonfinite, grad_norm, grad_norm_nonfinite,
    overflow), in step order."""
    return [tuple(r) for r in s.execute(
        select(StepHealth.step, StepHealth.loss, StepHealth.loss_nonfinite, StepHealth.grad_norm,
               StepHealth.grad_norm_nonfinite, StepHealth.overflow)
        .where(StepHealth.run_id == run_id)
        .order_by(StepHealth.step)
    )]


def newest_health_step(s: Session, run_id: int) -> int | None:
    """The newest step a health report exists for (the status page's "steps since" without the rows)."""
    return s.execute(select(func.max(StepHealth.step)).where(StepHealth.run_id == run_id)).scalar()


def delete_health(s: Session, run_id: int, from_step: int | None) -> tuple[int, int]:
    """Remove the run's health records at or after ``from_step`` (all when None): (removed, of
    them with a non-finite loss)."""
    where = [StepHealth.run_id == run_id]
    if from_step is not None:
        where.append(StepHealth.step >= from_step)
    nonfinite = s.execute(select(func.count()).select_from(StepHealth)
                          .where(*where, StepHealth.loss_nonfinite.is_not(None))).scalar_one()
    removed = s.execute(delete(StepHealth).where(*where)).rowcount
    return removed, nonfinite
