"""Catalog writes that stay correct with several daemons on one PostgreSQL catalog.

Registration is ``INSERT … ON CONFLICT DO NOTHING`` then ``SELECT`` (unique constraints decide,
not a read-then-write race). State changes are conditional updates (verification claims and
verdicts: :mod:`ckptd.catalog.verdicts`). Step states are recomputed under a row lock.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    DateTime,
    Select,
    bindparam,
    distinct,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ckptd.catalog.models import Checkpoint, Run, Shard, StrategyFile, VerificationEvent
from ckptd.catalog.pgbatch import column_arrays, unnest_rows
from ckptd.states import CONFIG_ERROR_CODES, SUPERSEDED_KIND, ShardState, StepState, allows_subset, step_state_from


def insert_ignore(session: Session, model: type, values: dict[str, Any], conflict: list[str]) -> bool:
    """Insert unless the unique key exists; True when this call inserted the row."""
    dialect = session.get_bind().dialect.name
    mod = postgresql if dialect == "postgresql" else sqlite
    table = model.__table__  # Core insert: the ORM variant hides whether the row was inserted
    stmt = mod.insert(table).values(**values).on_conflict_do_nothing(index_elements=conflict).returning(table.c.id)
    return session.execute(stmt).first() is not None


def for_update(stmt: Select, session: Session) -> Select:
    """``stmt`` reading rows this transaction will modify, locked until commit.

    PostgreSQL: row locks (``FOR UPDATE``). SQLite has no row locks: the database's write lock is
    taken *now*, before the read (``BEGIN IMMEDIATE``). Otherwise pysqlite's deferred transaction
    reads first, waits for the lock at its first write, and then writes what it derived from a
    read another thread's commit has made stale meanwhile (seen: a verifier worker stored a
    step's state as ``pending`` over the step check that had just passed). ``populate_existing``:
    objects this session loaded before the lock are refreshed from the locked read."""
    stmt = stmt.execution_options(populate_existing=True)
    if session.get_bind().dialect.name == "postgresql":
        return stmt.with_for_update()
    conn = session.connection()
    if not conn.connection.driver_connection.in_transaction:  # in one: an earlier write of ours holds the lock
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # through SQLAlchemy: a busy timeout raises its wrapped error
    return stmt


def get_or_create_run(session: Session, name: str, path: str) -> Run:
    insert_ignore(session, Run, {"name": name, "path": path, "created_at": datetime.now(timezone.utc)}, ["name"])
    return session.execute(select(Run).where(Run.name == name)).scalar_one()


def get_or_create_checkpoint(
    session: Session, run: Run, prefix: str, epoch: int, step: int, kind: str, expected_ranks: int | None
) -> Checkpoint:
    now = datetime.now(timezone.utc)
    insert_ignore(
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
            Checkpoint.strategy_hash == "",
        )
    ).scalar_one()


@dataclass(frozen=True)
class FileStat:
    size: int
    mtime_ns: int
    inode: int


@dataclass(frozen=True)
class ShardFile:
    """A settled shard file as ingest found it (one rank of one checkpoint)."""

    rank: int
    path: str
    stat: FileStat
    format: str


@dataclass(frozen=True)
class Registered:
    shard_id: int
    state: str
    changed: bool  # new row, or the file on disk is not the one catalogued: it must be (re-)verified
    moved_from: int | None = None  # the checkpoint the row belonged to before (a superseded shard rewritten)


_ROWS_PER_SELECT = 500  # well under SQLite's bound-parameter limit


@dataclass(frozen=True)
class Owner:
    """Who may judge a file (docs/ARCHITECTURE.md, *Nodes*): ``node`` is this daemon's node;
    ``dead`` the nodes unreachable now, whose files this node takes over when it sees them;
    ``shared`` the other nodes whose sharing marker is visible in this node's root (they watch
    the same filesystem); ``sole``: this node has been the only one registered for a whole node
    timeout, so rows without a node (from before migration 0006) that it cannot see are gone."""

    node: str
    dead: frozenset[str] = frozenset()
    sole: bool = True
    shared: frozenset[str] = frozenset()

    def owns(self, row_node: str | None) -> bool:
        return row_node == self.node or (row_node is None and self.sole)

    def may_take(self, row_node: str | None) -> bool:
        """A file this node sees whose row it may claim: unowned, or its owner is unreachable."""
        return row_node is None or row_node == self.node or row_node in self.dead

    def may_judge_gone(self, row_node: str | None) -> bool:
        """A file this node does not see is gone only if this node could have seen it: its own,
        an unowned one when it is sole, or an unreachable node's on a filesystem both share.
        (A node-local disk of another node is simply invisible here: not seeing is no proof.)"""
        return self.owns(row_node) or (row_node in self.dead and row_node in self.shared)

    def owned_clause(self):  # noqa: ANN201 - a SQLAlchemy clause
        return or_(Shard.node == self.node, Shard.node.is_(None)) if self.sole else Shard.node == self.node

    def judged_clause(self):  # noqa: ANN201 - a SQLAlchemy clause
        """The rows ``may_judge_gone`` admits, as SQL."""
        orphans = sorted(self.dead & self.shared)
        return or_(self.owned_clause(), Shard.node.in_(orphans)) if orphans else self.owned_clause()


# this machine as the only node: the default of callers without a daemon (tests, tools); the same
# name as Settings.node_name's default, so their rows and a default daemon's are one node's
LOCAL = Owner(socket.gethostname() or "localhost")


def run_layout(session: Session, ckpt: Checkpoint) -> str | None:
    """The layout of the run a step belongs to (``ckptd.runlayout``; None before migration 0005)."""
    run = session.get(Run, ckpt.run_id)
    return run.layout if run is not None else None


def shard_paths(session: Session, ckpt_id: int) -> list[str]:
    """Paths of a step's shards that are part of it now (not deleted, not superseded)."""
    return list(session.execute(select(Shard.path).where(
        Shard.checkpoint_id == ckpt_id,
        Shard.state.notin_((ShardState.DELETED.value, ShardState.SUPERSEDED.value)))).scalars())


_REGISTER_ARRAYS = {"rank": "integer[]", "path": "text[]", "size": "bigint[]", "mtime_ns": "bigint[]",
                    "inode": "bigint[]", "format": "varchar[]"}
_PG_REGISTER_SHARDS = text(
    "INSERT INTO shards (checkpoint_id, rank, path, size, mtime_ns, inode, state, format, quarantined, verify_seq,"
    " seen_at, node)"
    f" SELECT :ckpt, v.rank, v.path, v.size, v.mtime_ns, v.inode, '{ShardState.COMPLETE.value}', v.format, false, 0,"
    f" :now, :node FROM {unnest_rows(_REGISTER_ARRAYS)} ON CONFLICT (path) DO NOTHING RETURNING id, path"
).bindparams(bindparam("now", type_=DateTime(timezone=True)))
def register_shards(
    session: Session, ckpt: Checkpoint, files: list[ShardFile], layout_now: tuple[int, int] | None = None,
    owner: Owner = LOCAL,
) -> list[Registered]:
    """Insert the rows of new shard files of one checkpoint (caller holds its lock) in multi-row
    ``INSERT … ON CONFLICT DO NOTHING RETURNING`` statements; paths already catalogued are
    compared with what is on disk. Returns one ``Registered`` per file, in order.

    ``layout_now``: (world size, appeared_ns) of the run's current strategy. A superseded file
    that changed comes back to the step only if it can belong to that layout (states.layout_resave:
    a rank inside its world, written after it appeared); a leftover merely touched stays history."""
    now = datetime.now(timezone.utc)
    dialect = session.get_bind().dialect.name
    table = Shard.__table__
    rows = [
        {
            "checkpoint_id": ckpt.id, "rank": f.rank, "path": f.path, "size": f.stat.size, "mtime_ns": f.stat.mtime_ns,
            "inode": f.stat.inode, "state": ShardState.COMPLETE.value, "format": f.format, "quarantined": False,
            "verify_seq": 0, "seen_at": now, "node": owner.node,
        }
        for f in files
    ]
    if dialect == "postgresql":  # a conflicting row (already catalogued) returns nothing
        inserted = {path: sid for sid, path in session.connection().execute(
            _PG_REGISTER_SHARDS, {"ckpt": ckpt.id, "now": now, "node": owner.node} | column_arrays(rows, _REGISTER_ARRAYS))}
    else:
        stmt = sqlite.insert(table).on_conflict_do_nothing(index_elements=["path"]).returning(table.c.id, table.c.path)
        # executemany + RETURNING: SQLAlchemy batches it into multi-row VALUES ("insertmanyvalues")
        # from one cached compilation
        inserted = {path: sid for sid, path in session.connection().execute(stmt, rows)}
    known = [f for f in files if f.path not in inserted]
    if known:  # lock order: the step (held), its history rows, then shard rows — a known path may be history's
        history_rows(session, ckpt)
    existing: dict[str, Shard] = {}
    for i in range(0, len(known), _ROWS_PER_SELECT):
        paths = [f.path for f in known[i : i + _ROWS_PER_SELECT]]
        q = for_update(select(Shard).where(Shard.path.in_(paths)).order_by(Shard.id), session)
        existing.update({row.path: row for row in session.execute(q).scalars()})
    out = []
    for f in files:
        if f.path in inserted:
            out.append(Registered(inserted[f.path], ShardState.COMPLETE.value, True))
            continue
        shard = existing[f.path]
        st = f.stat
        if not owner.may_take(shard.node):
            # another live node's file (a shared filesystem shows it to us too): only it judges it
            out.append(Registered(shard.id, shard.state, False))
            continue
        if shard.node != owner.node:  # unclaimed (pre-0006) or its node is unreachable: ours now
            session.execute(update(Shard).where(Shard.id == shard.id).values(node=owner.node))
        changed = (shard.size, shard.mtime_ns, shard.inode) != (st.size, st.mtime_ns, st.inode)
        if (changed and shard.state == ShardState.SUPERSEDED.value and layout_now is not None
                and not (f.rank < layout_now[0] and st.mtime_ns >= layout_now[1])):
            # a leftover of an older layout touched or restored: it cannot be the current layout's
            session.execute(update(Shard).where(Shard.id == shard.id).values(
                size=st.size, mtime_ns=st.mtime_ns, inode=st.inode, seen_at=now))
            out.append(Registered(shard.id, shard.state, False))
            continue
        if changed or shard.state == ShardState.DELETED.value:
            # read before the update: it synchronizes the loaded row
            moved = shard.checkpoint_id if shard.checkpoint_id != ckpt.id else None
            # the file was replaced or came back: everything we knew about it is void
            session.execute(
                update(Shard)
                .where(Shard.id == shard.id)
                .values(
                    size=st.size, mtime_ns=st.mtime_ns, inode=st.inode, state=ShardState.COMPLETE.value, digest=None,
                    verify_seq=Shard.verify_seq + 1,  # verifications of the old file can no longer store
                    crc=None, encryption=None, global_step=None, error_code=None, error=None, quarantined=False,
                    verified_at=None, seen_at=now, checkpoint_id=ckpt.id, rank=f.rank,
                )
            )
            add_event(session, ckpt.id, shard.id, "rescan", "changed", "file size/mtime/inode changed on disk; re-verifying")
            out.append(Registered(shard.id, ShardState.COMPLETE.value, True, moved))
        else:
            out.append(Registered(shard.id, shard.state, False))
    return out


def history_rows(session: Session, ckpt: Checkpoint) -> list[Checkpoint]:
    """The superseded-history rows of a step (locked; caller holds the step's lock; see
    ckptd.catalog.layout_history)."""
    q = select(Checkpoint).where(
        Checkpoint.run_id == ckpt.run_id, Checkpoint.prefix == ckpt.prefix, Checkpoint.epoch == ckpt.epoch,
        Checkpoint.step == ckpt.step, Checkpoint.kind == SUPERSEDED_KIND,
    ).order_by(Checkpoint.id)
    return list(session.execute(for_update(q, session)).scalars())


def mark_deleted(session: Session, shard: Shard) -> None:
    session.execute(update(Shard).where(Shard.id == shard.id).values(state=ShardState.DELETED.value))
    add_event(session, shard.checkpoint_id, shard.id, "rescan", "deleted", "file no longer on disk")


def add_event(
    session: Session, ckpt_id: int | None, shard_id: int | None, kind: str, outcome: str, detail: str | None, seconds: float | None = None
) -> None:
    session.add(VerificationEvent(checkpoint_id=ckpt_id, shard_id=shard_id, kind=kind, outcome=outcome, detail=detail, seconds=seconds))


def lock_checkpoint(session: Session, ckpt_id: int) -> Checkpoint:
    return session.execute(for_update(select(Checkpoint).where(Checkpoint.id == ckpt_id), session)).scalar_one()


def recompute_step_state(session: Session, ckpt: Checkpoint) -> StepState:
    """Derive and store the step's state from its shard rows (caller holds the row lock)."""
    if ckpt.state == StepState.DELETING.value:
        return StepState.DELETING  # retention owns it now; file deletions are expected
    if ckpt.kind == SUPERSEDED_KIND:
        return StepState.SUPERSEDED  # a history row: nothing to derive (its files may come and go)
    # aggregates, not rows: this runs for every shard event of a step with hundreds of ranks
    own = (Shard.checkpoint_id == ckpt.id, Shard.state != ShardState.SUPERSEDED.value)
    counts = dict(session.execute(select(Shard.state, func.count()).where(*own).group_by(Shard.state)).all())
    ranks = session.execute(select(func.count(distinct(Shard.rank))).where(*own)).scalar_one()
    duplicate = sum(counts.values()) > ranks
    states = {ShardState(st) for st in counts}
    checks = False if duplicate else ckpt.step_checks_ok
    run = session.get(Run, ckpt.run_id)  # in the identity map already on every hot path
    subset = ckpt.kind != "converted" and run is not None and allows_subset(run.layout)
    new = step_state_from(ckpt.expected_ranks, ranks, states, checks, subset)
    if new.value != ckpt.state:
        ckpt.state = new.value
    if duplicate and not ckpt.reason:
        ckpt.reason = "a rank has more than one shard file for this step"
    elif new == StepState.CORRUPT and ckpt.step_checks_ok is not False:
        ckpt.reason = _shard_failures(session, ckpt.id)  # the evidence, not just "corrupt"
    return new


def _shard_failures(session: Session, ckpt_id: int) -> str:
    bad = session.execute(
        select(Shard.rank, Shard.error, Shard.error_code).where(
            Shard.checkpoint_id == ckpt_id, Shard.state == ShardState.CORRUPT.value).order_by(Shard.rank)
    ).all()
    text = "; ".join(f"rank {rank}: {error or 'failed verification'}" for rank, error, _ in bad[:3])
    text += f"; and {len(bad) - 3} more ranks" if len(bad) > 3 else ""
    if bad and all(code in CONFIG_ERROR_CODES for _, _, code in bad):
        # not data corruption: a daemon restarted with the right key or policy re-verifies them
        text = ("configuration, not data: the daemon's key or encryption policy does not fit these files "
                "(restart it with the right --key-file; they are re-verified then): " + text)
    return text


def upsert_strategy(
    session: Session, run: Run, path: str, content_hash: str, fmt: str, world: int, stages: int, error: str | None,
    content: bytes | None = None, mtime_ns: int | None = None,
) -> StrategyFile:
    """The row for this (path, content); a changed file gets a new row, old steps keep theirs.
    ``mtime_ns``: the file's mtime as read now, stored when the content is new at this path."""
    insert_ignore(
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
            "mtime_ns": mtime_ns,
        },
        ["run_id", "path", "content_hash"],
    )
    row = session.execute(select(StrategyFile).where(
        StrategyFile.run_id == run.id, StrategyFile.path == path, StrategyFile.content_hash == content_hash)).scalar_one()
    head = session.execute(select(StrategyFile.id).where(StrategyFile.run_id == run.id, StrategyFile.path == path)
                           .order_by(StrategyFile.seen_at.desc(), StrategyFile.id.desc()).limit(1)).scalar_one()
    if head != row.id:  # the file went back to a content it had before: that layout is the newest again
        row.seen_at, row.mtime_ns = datetime.now(timezone.utc), mtime_ns
    return row


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
