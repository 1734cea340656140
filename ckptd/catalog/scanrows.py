"""The rows that ingest reconciles with the disk: what a rescan compares against, which rows a
vanished, replaced or newly seen file touches, and the strategy rows a run's layout is read from
(``ckptd.service.ingest``, ``replaced``, ``rank_strategies`` decide; this reads and writes).

Callers lock a checkpoint row (``repo.lock_checkpoint``) before writing any of its shard rows
(docs/ARCHITECTURE.md, *Concurrency rules*); ``claim_paths`` writes only ``shards.node``.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, defer

from ckptd.catalog.models import Checkpoint, Run, Shard, StrategyFile
from ckptd.catalog.repo import Owner
from ckptd.states import ShardState, StepState

_NOT_IN_A_STEP = (ShardState.DELETED.value, ShardState.SUPERSEDED.value)  # the states of rows that are no part of a step

# --- rescans -----------------------------------------------------------------------------------


def steps_awaiting_checks(s: Session, run_names: list[str]) -> list[int]:
    """The runs' steps whose shards are all verified but whose step checks never ran."""
    return list(s.execute(
        select(Checkpoint.id).join(Run, Checkpoint.run_id == Run.id).where(
            Run.name.in_(run_names), Checkpoint.state == StepState.PENDING.value, Checkpoint.step_checks_ok.is_(None))
    ).scalars())


def shard_stats_below(s: Session, prefix: str, states: Iterable[str]) -> list[tuple]:
    """(path, size, mtime_ns, inode, id, state, node, verified_config, error_code) of every shard
    row in ``states`` whose path starts with ``prefix``."""
    return [tuple(r) for r in s.execute(
        select(Shard.path, Shard.size, Shard.mtime_ns, Shard.inode, Shard.id, Shard.state, Shard.node,
               Shard.verified_config, Shard.error_code).where(
            Shard.path.startswith(prefix, autoescape=True), Shard.state.in_(tuple(states)))
    )]


def shard_id_at(s: Session, path: str) -> int | None:
    return s.execute(select(Shard.id).where(Shard.path == path)).scalar_one_or_none()


def checkpoints_of(s: Session, paths: list[str]) -> list[tuple[str, int]]:
    """(path, checkpoint id) of the shard rows at ``paths`` (callers batch them)."""
    return [tuple(r) for r in s.execute(select(Shard.path, Shard.checkpoint_id).where(Shard.path.in_(paths)))]


def undeleted_shards_at(s: Session, paths: list[str]) -> list[Shard]:
    return list(s.execute(select(Shard).where(Shard.path.in_(paths), Shard.state != ShardState.DELETED.value)).scalars())


def judged_paths_below(s: Session, prefix: str, owner: Owner) -> list[str]:
    """Paths below ``prefix`` of the rows not deleted that ``owner`` may judge gone."""
    return list(s.execute(
        select(Shard.path).where(Shard.state != ShardState.DELETED.value, Shard.path.startswith(prefix, autoescape=True),
                                 owner.judged_clause())
    ).scalars())


def claim_paths(s: Session, paths: list[str], owner: Owner) -> None:
    """The rows at ``paths`` with no node or an unreachable one become ``owner``'s node's."""
    s.execute(update(Shard).where(
        Shard.path.in_(paths), or_(Shard.node.is_(None), Shard.node.in_(sorted(owner.dead)))).values(node=owner.node))


def resaved_candidates(s: Session, run_id: int, older: list[int], appeared_ns: int, world_size: int,
                       kinds: Iterable[str]) -> list[int]:
    """The run's steps (of ``kinds``) bound to one of the strategy rows ``older`` that have a
    shard of a rank below ``world_size`` written at or after ``appeared_ns``."""
    written_after = select(Shard.id).where(
        Shard.checkpoint_id == Checkpoint.id, Shard.mtime_ns >= appeared_ns, Shard.rank < world_size)
    return list(s.execute(select(Checkpoint.id).where(
        Checkpoint.run_id == run_id, Checkpoint.kind.in_(tuple(kinds)),
        Checkpoint.strategy_id.in_(older), written_after.exists())).scalars())


def steps_of_kinds(s: Session, run_id: int, kinds: Iterable[str]) -> list[Checkpoint]:
    return list(s.execute(select(Checkpoint).where(
        Checkpoint.run_id == run_id, Checkpoint.kind.in_(tuple(kinds)))).scalars())


# --- replaced files ----------------------------------------------------------------------------


def live_rows_at(s: Session, paths: list[str]) -> list[tuple[int, str, int, str | None, str | None]]:
    """(id, path, checkpoint id, node, error) of the rows at ``paths`` that are part of a step."""
    return [tuple(r) for r in s.execute(select(Shard.id, Shard.path, Shard.checkpoint_id, Shard.node, Shard.error).where(
        Shard.path.in_(paths), Shard.state.notin_(_NOT_IN_A_STEP)))]


def mark_replaced(s: Session, shard_id: int, error_code: str, error: str) -> None:
    """The shard is corrupt: its file was replaced by something ckptd never reads (the
    checkpoint row locked first)."""
    s.execute(update(Shard).where(Shard.id == shard_id).values(
        state=ShardState.CORRUPT.value, error_code=error_code, error=error, size=0, mtime_ns=0, inode=0))


def unexplained_incomplete(s: Session, run_name: str, *, name: tuple[str, int, int, str] | None = None,
                           missing_rank: int | None = None) -> list[int]:
    """The run's incomplete steps without a reason: the one named (prefix, epoch, step, kind), or
    those with no live row of ``missing_rank``."""
    where = []
    if name is not None:
        prefix, epoch, step, kind = name
        where += [Checkpoint.prefix == prefix, Checkpoint.epoch == epoch, Checkpoint.step == step,
                  Checkpoint.kind == kind]
    if missing_rank is not None:
        where.append(~select(Shard.id).where(Shard.checkpoint_id == Checkpoint.id, Shard.rank == missing_rank,
                                             Shard.state != ShardState.DELETED.value).exists())
    return list(s.execute(select(Checkpoint.id).join(Run, Run.id == Checkpoint.run_id).where(
        Run.name == run_name, Checkpoint.state == StepState.INCOMPLETE.value, Checkpoint.reason.is_(None),
        *where)).scalars())


# --- strategy rows -----------------------------------------------------------------------------


def valid_strategies(s: Session, run_id: int, *, content: bool = True) -> list[StrategyFile]:
    """The run's strategy rows that parsed, newest first (``content=False``: the blobs are
    deferred, one query when they are not needed)."""
    q = select(StrategyFile)
    if not content:
        q = q.options(defer(StrategyFile.content))
    return list(s.execute(q.where(StrategyFile.run_id == run_id, StrategyFile.error.is_(None))
                          .order_by(StrategyFile.seen_at.desc(), StrategyFile.id.desc())).scalars())


def strategy_error_recorded(s: Session, run_id: int, path: str, error: str) -> bool:
    return s.execute(select(StrategyFile.id).where(
        StrategyFile.run_id == run_id, StrategyFile.path == path, StrategyFile.error == error)).first() is not None
