"""The rows a step check reads and the facts it shares: the catalog side of
``ckptd.service.stepjudge`` (which decides when a step is judged and what its verdict is; this
reads and writes).

Callers hold the step's row lock (``repo.lock_checkpoint``) before writing any of its shard rows
(docs/ARCHITECTURE.md, *Concurrency rules*).
"""

from __future__ import annotations

from sqlalchemy import Row, select, update
from sqlalchemy.orm import Session

from ckptd.catalog.models import Shard, StrategyFile
from ckptd.states import ShardState

#: the columns of :func:`live_shard_rows`, in this order (the step judge's row type is built from
#: them positionally, so a column is added here and there together)
SHARD_ROW_COLUMNS = (Shard.id, Shard.rank, Shard.path, Shard.size, Shard.mtime_ns, Shard.inode, Shard.state,
                     Shard.verify_seq, Shard.facts)


def shard_states(s: Session, ckpt_id: int) -> list[Row]:
    """(rank, path, state) of the step's shards that are not deleted: the three columns the
    readiness check needs (it runs after every verified batch, so it reads no more)."""
    return list(s.execute(select(Shard.rank, Shard.path, Shard.state).where(
        Shard.checkpoint_id == ckpt_id, Shard.state != ShardState.DELETED.value)).all())


def live_shard_rows(s: Session, ckpt_id: int) -> list[Row]:
    """:data:`SHARD_ROW_COLUMNS` of the step's shards that are not deleted, ordered by id: the
    order makes two reads comparable (a step check stores nothing if its shards changed between
    the read outside the lock and the one under it)."""
    return list(s.execute(select(*SHARD_ROW_COLUMNS).where(
        Shard.checkpoint_id == ckpt_id, Shard.state != ShardState.DELETED.value).order_by(Shard.id)).all())


def share_facts(s: Session, shard_id: int, seq: int, facts: str) -> None:
    """Store a shard's step-check facts for the nodes that cannot read its file, iff the shard is
    still at verification ``seq`` (facts of an older verification must not pass for the new one's)."""
    s.execute(update(Shard).where(Shard.id == shard_id, Shard.verify_seq == seq).values(facts=facts))


def global_steps(s: Session, ckpt_id: int) -> set[int | None]:
    """The distinct global steps the step's shards recorded (every row, deleted ones too: a step
    whose files disagree on it gets none)."""
    return set(s.execute(select(Shard.global_step).where(Shard.checkpoint_id == ckpt_id)).scalars())


def strategy_errors(s: Session, run_id: int) -> list[Row]:
    """(path, error) of every strategy row of the run, newest first (the caller picks the newest
    of the run's own strategy: its error, or None when it is readable)."""
    return list(s.execute(select(StrategyFile.path, StrategyFile.error).where(StrategyFile.run_id == run_id)
                          .order_by(StrategyFile.seen_at.desc(), StrategyFile.id.desc())).all())
