"""Catalog writes that stay correct with several daemons on one PostgreSQL catalog.

Registration is ``INSERT … ON CONFLICT DO NOTHING`` then ``SELECT`` (unique constraints decide,
not a read-then-write race). State changes are conditional updates: a verification result is
written only if the shard still has the size/mtime/inode that was verified, so a stale result
can never overwrite a newer file's state. Step states are recomputed under a row lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Select, distinct, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ckptd.catalog.models import Checkpoint, Run, Shard, StrategyFile, VerificationEvent
from ckptd.states import ShardState, StepState, step_state_from


def _insert_ignore(session: Session, model: type, values: dict[str, Any], conflict: list[str]) -> bool:
    """Insert unless the unique key exists; True when this call inserted the row."""
    dialect = session.get_bind().dialect.name
    mod = postgresql if dialect == "postgresql" else sqlite
    table = model.__table__  # Core insert: the ORM variant hides whether the row was inserted
    stmt = mod.insert(table).values(**values).on_conflict_do_nothing(index_elements=conflict).returning(table.c.id)
    return session.execute(stmt).first() is not None


def _lock(stmt: Select, session: Session) -> Select:
    return stmt.with_for_update() if session.get_bind().dialect.name == "postgresql" else stmt


def get_or_create_run(session: Session, name: str, path: str) -> Run:
    _insert_ignore(session, Run, {"name": name, "path": path, "created_at": datetime.now(timezone.utc)}, ["name"])
    return session.execute(select(Run).where(Run.name == name)).scalar_one()


def get_or_create_checkpoint(
    session: Session, run: Run, prefix: str, epoch: int, step: int, kind: str, expected_ranks: int | None
) -> Checkpoint:
    now = datetime.now(timezone.utc)
    _insert_ignore(
        session,
        Checkpoint,
        {
            "run_id": run.id,
            "prefix": prefix,
            "epoch": epoch,
            "step": step,
            "kind": kind,
            "layout": "",
            "state": StepState.INCOMPLETE.value,
            "expected_ranks": expected_ranks,
            "pinned": False,
            "marked_bad": False,
            "created_at": now,
            "updated_at": now,
        },
        ["run_id", "prefix", "epoch", "step", "kind", "layout"],
    )
    return session.execute(
        select(Checkpoint).where(
            Checkpoint.run_id == run.id,
            Checkpoint.prefix == prefix,
            Checkpoint.epoch == epoch,
            Checkpoint.step == step,
            Checkpoint.kind == kind,
            Checkpoint.layout == "",
        )
    ).scalar_one()


@dataclass(frozen=True)
class FileStat:
    size: int
    mtime_ns: int
    inode: int


def register_shard(session: Session, ckpt: Checkpoint, rank: int, path: str, st: FileStat, fmt: str) -> tuple[Shard, bool]:
    """Insert the shard row if new. Returns (shard, changed): changed when the row is new or the
    file on disk is not the one catalogued (replaced/rewritten) — then it must be re-verified."""
    now = datetime.now(timezone.utc)
    inserted = _insert_ignore(
        session,
        Shard,
        {
            "checkpoint_id": ckpt.id,
            "rank": rank,
            "path": path,
            "size": st.size,
            "mtime_ns": st.mtime_ns,
            "inode": st.inode,
            "state": ShardState.COMPLETE.value,
            "format": fmt,
            "quarantined": False,
            "verify_seq": 0,
            "seen_at": now,
        },
        ["path"],
    )
    shard = session.execute(_lock(select(Shard).where(Shard.path == path), session)).scalar_one()
    if inserted:
        return shard, True
    if (shard.size, shard.mtime_ns, shard.inode) != (st.size, st.mtime_ns, st.inode) or shard.state == ShardState.DELETED.value:
        # the file was replaced or came back: everything we knew about it is void
        session.execute(
            update(Shard)
            .where(Shard.id == shard.id)
            .values(
                size=st.size, mtime_ns=st.mtime_ns, inode=st.inode, state=ShardState.COMPLETE.value, digest=None,
                verify_seq=Shard.verify_seq + 1,  # verifications of the old file can no longer store
                crc=None, encryption=None, global_step=None, error_code=None, error=None, quarantined=False,
                verified_at=None, seen_at=now, checkpoint_id=ckpt.id, rank=rank,
            )
        )
        add_event(session, ckpt.id, shard.id, "rescan", "changed", "file size/mtime/inode changed on disk; re-verifying")
        session.refresh(shard)
        return shard, True
    return shard, False


def claim_verification(session: Session, shard_id: int) -> int:
    """Start a verification: bump and return the shard's sequence number (see ``record_verification``)."""
    session.execute(update(Shard).where(Shard.id == shard_id).values(verify_seq=Shard.verify_seq + 1))
    return session.execute(select(Shard.verify_seq).where(Shard.id == shard_id)).scalar_one()


def record_verification(
    session: Session, shard_id: int, st: FileStat, *, state: ShardState, values: dict[str, Any], detail: str | None,
    seconds: float, seq: int | None = None,
) -> bool:
    """Store a verification outcome iff the shard is still the file that was verified and no
    verification started after this one (``seq`` from ``claim_verification``)."""
    cond = [
        Shard.id == shard_id,
        Shard.size == st.size,
        Shard.mtime_ns == st.mtime_ns,
        Shard.inode == st.inode,
        Shard.state != ShardState.DELETED.value,
    ]
    if seq is not None:
        cond.append(Shard.verify_seq == seq)
    res = session.execute(
        update(Shard)
        .where(*cond)
        .values(state=state.value, verified_at=datetime.now(timezone.utc), quarantined=state == ShardState.CORRUPT, **values)
    )
    if res.rowcount:
        ckpt_id = session.execute(select(Shard.checkpoint_id).where(Shard.id == shard_id)).scalar_one()
        add_event(session, ckpt_id, shard_id, "shard", state.value, detail, seconds)
    return bool(res.rowcount)


def mark_deleted(session: Session, shard: Shard) -> None:
    session.execute(update(Shard).where(Shard.id == shard.id).values(state=ShardState.DELETED.value))
    add_event(session, shard.checkpoint_id, shard.id, "rescan", "deleted", "file no longer on disk")


def add_event(
    session: Session, ckpt_id: int | None, shard_id: int | None, kind: str, outcome: str, detail: str | None, seconds: float | None = None
) -> None:
    session.add(VerificationEvent(checkpoint_id=ckpt_id, shard_id=shard_id, kind=kind, outcome=outcome, detail=detail, seconds=seconds))


def lock_checkpoint(session: Session, ckpt_id: int) -> Checkpoint:
    return session.execute(_lock(select(Checkpoint).where(Checkpoint.id == ckpt_id), session)).scalar_one()


def recompute_step_state(session: Session, ckpt: Checkpoint) -> StepState:
    """Derive and store the step's state from its shard rows (caller holds the row lock)."""
    if ckpt.state == StepState.DELETING.value:
        return StepState.DELETING  # retention owns it now; file deletions are expected
    # aggregates, not rows: this runs for every shard event of a step with hundreds of ranks
    counts = dict(session.execute(
        select(Shard.state, func.count()).where(Shard.checkpoint_id == ckpt.id).group_by(Shard.state)).all())
    ranks = session.execute(select(func.count(distinct(Shard.rank))).where(Shard.checkpoint_id == ckpt.id)).scalar_one()
    duplicate = sum(counts.values()) > ranks
    states = {ShardState(st) for st in counts}
    checks = False if duplicate else ckpt.step_checks_ok
    new = step_state_from(ckpt.expected_ranks, ranks, states, checks)
    if new.value != ckpt.state:
        ckpt.state = new.value
    if duplicate and not ckpt.reason:
        ckpt.reason = "a rank has more than one shard file for this step"
    elif new == StepState.CORRUPT and ckpt.step_checks_ok is not False:
        ckpt.reason = _shard_failures(session, ckpt.id)  # the evidence, not just "corrupt"
    return new


def _shard_failures(session: Session, ckpt_id: int) -> str:
    bad = session.execute(
        select(Shard.rank, Shard.error).where(Shard.checkpoint_id == ckpt_id, Shard.state == ShardState.CORRUPT.value)
        .order_by(Shard.rank)
    ).all()
    text = "; ".join(f"rank {rank}: {error or 'failed verification'}" for rank, error in bad[:3])
    return text + (f"; and {len(bad) - 3} more ranks" if len(bad) > 3 else "")


def upsert_strategy(
    session: Session, run: Run, path: str, content_hash: str, fmt: str, world: int, stages: int, error: str | None,
    content: bytes | None = None,
) -> StrategyFile:
    """The row for this (path, content); a changed file gets a new row, old steps keep theirs."""
    _insert_ignore(
        session,
        StrategyFile,
        {
            "run_id": run.id,
            "path": path,
            "content_hash": content_hash,
            "format": fmt,
            "world_size": world,
            "stages": stages,
            "error": error,
            "content": content,
            "seen_at": datetime.now(timezone.utc),
        },
        ["run_id", "path", "content_hash"],
    )
    return session.execute(select(StrategyFile).where(
        StrategyFile.run_id == run.id, StrategyFile.path == path, StrategyFile.content_hash == content_hash)).scalar_one()


def latest_restorable(session: Session, run_id: int, *, max_step: int | None = None) -> Checkpoint | None:
    """Newest verified trained checkpoint of a run (index ``ix_checkpoints_run_state_order``)."""
    q = select(Checkpoint).where(
        Checkpoint.run_id == run_id,
        Checkpoint.state == StepState.VERIFIED.value,
        Checkpoint.kind == "trained",
        Checkpoint.marked_bad.is_(False),
    )
    if max_step is not None:
        q = q.where(Checkpoint.step <= max_step)
    return session.execute(q.order_by(Checkpoint.epoch.desc(), Checkpoint.step.desc()).limit(1)).scalar_one_or_none()
