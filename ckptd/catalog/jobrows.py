"""The rows of background work: jobs (``jobs``), conversions (``conversion_jobs``) and the shard
and step rows they read (``ckptd.service.jobs``, ``jobrunner``, ``conversions`` decide; this
reads and writes). ``active`` is always the caller's tuple of states a live process is
responsible for (``ckptd.service.jobs.ACTIVE``): one definition, passed in.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from ckptd.catalog import repo
from ckptd.catalog.models import Checkpoint, ConversionJob, Job, Run, Shard
from ckptd.states import ShardState, StepState

# --- jobs --------------------------------------------------------------------------------------


def recent_jobs(s: Session, limit: int) -> list[Job]:
    return list(s.execute(select(Job).order_by(Job.id.desc()).limit(limit)).scalars())


def jobs_in(s: Session, kind: str, states: tuple[str, ...]) -> list[tuple[Job, str | None]]:
    """(job, its run's name) of the jobs of ``kind`` in ``states``, by id (``/metrics``: the
    running conversions)."""
    q = (select(Job, Run.name).outerjoin(Run, Run.id == Job.run_id)
         .where(Job.kind == kind, Job.state.in_(states)).order_by(Job.id))
    return [(job, name) for job, name in s.execute(q)]


def convert_jobs(s: Session) -> list[Job]:
    return list(s.execute(select(Job).where(Job.kind == "convert")).scalars())


def lock_active_jobs(s: Session, active: tuple[str, ...]) -> list[Job]:
    """The jobs in ``active`` states, locked in id order until commit."""
    return list(s.execute(repo.for_update(select(Job).where(Job.state.in_(active)).order_by(Job.id), s)).scalars())


def renew_jobs(s: Session, job_ids: list[int], active: tuple[str, ...], now: datetime) -> None:
    """Heartbeat: ``updated_at = now`` on those of ``job_ids`` still in an ``active`` state."""
    s.execute(update(Job).where(Job.id.in_(job_ids), Job.state.in_(active)).values(updated_at=now))


def end_job(s: Session, job_id: int, active: tuple[str, ...], **values: Any) -> None:
    """Set ``values`` on the job only while it is still in an ``active`` state (the first end wins)."""
    s.execute(update(Job).where(Job.id == job_id, Job.state.in_(active)).values(**values))


def live_shards(s: Session, run_id: int, ckpt_id: int | None) -> list[tuple[int, str, int, str | None]]:
    """(id, path, checkpoint id, node) of the run's (or one step's) shard rows that are part of a
    step (not deleted, not superseded), by step and rank."""
    q = select(Shard.id, Shard.path, Shard.checkpoint_id, Shard.node).join(Checkpoint, Shard.checkpoint_id == Checkpoint.id).where(
        Checkpoint.run_id == run_id,
        Shard.state.notin_((ShardState.DELETED.value, ShardState.SUPERSEDED.value)),  # history rows are no steps
    )
    if ckpt_id is not None:
        q = q.where(Checkpoint.id == ckpt_id)
    return [tuple(r) for r in s.execute(q.order_by(Checkpoint.step, Shard.rank))]


def shard_nodes(s: Session, shard_ids: list[int]) -> dict[int, str | None]:
    """shard id -> the node holding it, of the rows that still exist."""
    return dict(s.execute(select(Shard.id, Shard.node).where(Shard.id.in_(shard_ids))).all())


# --- conversions -------------------------------------------------------------------------------


def verified_files(s: Session, ckpt_id: int) -> dict[int, str]:
    """rank -> path of a step's verified shards."""
    return dict(s.execute(select(Shard.rank, Shard.path).where(
        Shard.checkpoint_id == ckpt_id, Shard.state == ShardState.VERIFIED.value)).all())


def verified_bytes(s: Session, ckpt_id: int) -> int:
    """The bytes of a step's verified shard files (their sizes when verified)."""
    total = s.execute(select(func.sum(Shard.size)).where(
        Shard.checkpoint_id == ckpt_id, Shard.state == ShardState.VERIFIED.value)).scalar_one()
    return int(total or 0)


def trained_saves(s: Session, run_id: int, step: int) -> list[Checkpoint]:
    """Every trained save at ``step`` (its global step, or — not known yet — its file names'
    step), newest first."""
    return list(s.execute(select(Checkpoint).where(
        Checkpoint.run_id == run_id, Checkpoint.kind == "trained",
        or_(Checkpoint.global_step == step, and_(Checkpoint.global_step.is_(None), Checkpoint.step == step)),
    ).order_by(Checkpoint.epoch.desc(), Checkpoint.incarnation.desc(), Checkpoint.id.desc())).scalars())


def rank_states(s: Session, ckpt_id: int) -> dict[int, str]:
    """rank -> shard state of a step's rows that are part of it (history rows left out)."""
    return dict(s.execute(select(Shard.rank, Shard.state).where(
        Shard.checkpoint_id == ckpt_id, Shard.state != ShardState.SUPERSEDED.value)).all())


def verified_copy(s: Session, src_id: int, target_hash: str) -> Checkpoint | None:
    """The verified converted copy of step ``src_id`` into the layout ``target_hash``."""
    return s.execute(select(Checkpoint).where(
        Checkpoint.derived_from_id == src_id, Checkpoint.kind == "converted", Checkpoint.strategy_hash == target_hash,
        Checkpoint.state == StepState.VERIFIED.value)).scalars().first()


def finished_conversion(s: Session, copy_id: int, out: str) -> ConversionJob | None:
    """The newest finished conversion that wrote copy ``copy_id`` into ``out``."""
    return s.execute(select(ConversionJob).where(
        ConversionJob.output_checkpoint_id == copy_id, ConversionJob.state == "done", ConversionJob.out_dir == out,
    ).order_by(ConversionJob.id.desc())).scalars().first()


def shard_stats(s: Session, ckpt_id: int) -> list[tuple[str, int, int, int]]:
    """(path, size, mtime_ns, inode) of every shard row of a checkpoint."""
    return [tuple(r) for r in s.execute(select(Shard.path, Shard.size, Shard.mtime_ns, Shard.inode).where(
        Shard.checkpoint_id == ckpt_id))]


def conversions_of_run(s: Session, run_id: int) -> list[ConversionJob]:
    return list(s.execute(select(ConversionJob).where(ConversionJob.run_id == run_id)
                          .order_by(ConversionJob.id.desc())).scalars())


def lock_active_conversions(s: Session, active: tuple[str, ...]) -> list[ConversionJob]:
    """The conversions in ``active`` states, locked in id order until commit."""
    q = select(ConversionJob).where(ConversionJob.state.in_(active)).order_by(ConversionJob.id)
    return list(s.execute(repo.for_update(q, s)).scalars())


def abandoned_conversions(s: Session) -> list[tuple[int, str]]:
    """(id, out_dir) of the conversions failed as abandoned."""
    return [tuple(r) for r in s.execute(select(ConversionJob.id, ConversionJob.out_dir).where(
        ConversionJob.state == "failed", ConversionJob.error.startswith("abandoned: ")))]


def copy_row(s: Session, run_id: int, prefix: str, epoch: int, step: int, target_hash: str,
             lock: bool = False) -> Checkpoint | None:
    """The converted copy (any state) of the step (prefix, epoch, step) into ``target_hash``;
    ``lock``: locked until commit."""
    q = select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.prefix == prefix, Checkpoint.epoch == epoch,
                                 Checkpoint.step == step, Checkpoint.kind == "converted", Checkpoint.strategy_hash == target_hash)
    return s.execute(repo.for_update(q, s) if lock else q).scalars().first()


def shard_stats_and_nodes(s: Session, ckpt_id: int) -> list[tuple[str, int, int, int, str | None]]:
    """(path, size, mtime_ns, inode, node) of every shard row of a checkpoint."""
    return [tuple(r) for r in s.execute(select(Shard.path, Shard.size, Shard.mtime_ns, Shard.inode, Shard.node).where(
        Shard.checkpoint_id == ckpt_id))]


def shard_paths_under(s: Session, directory: str) -> list[str]:
    """Every shard row's path inside ``directory`` (a prefix match, LIKE wildcards escaped)."""
    return list(s.execute(select(Shard.path).where(
        Shard.path.startswith(os.path.join(directory, ""), autoescape=True))).scalars())
