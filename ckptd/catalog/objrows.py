"""The object tier's catalog reads and writes (``ckptd.service.objtier``).

An object copy row goes ``complete`` when its object is up and read back, and ``verified`` only
once the step's manifest is written (the manifest is the commit: a step whose copies are merely
``complete`` is not on the tier, so ``copies.whole_steps`` / ``whole_tiers`` never count it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from ckptd.catalog import repo
from ckptd.catalog.models import Checkpoint, Run, Shard, ShardCopy, StrategyFile, utcnow
from ckptd.states import ShardState, StepState, Tier

_OBJ = Tier.OBJECT.value
_LIVE = (ShardState.COMPLETE.value, ShardState.VERIFIED.value)


@dataclass(frozen=True)
class StepToUpload:
    ckpt_id: int
    run: str
    run_path: str
    step: int  # the users' step (global step when known)
    #: (shard id, rank, path, size, digest) of this node's verified shards without a live object copy
    shards: list[tuple[int, int, str, int, str | None]]


def _users_step(c: Checkpoint) -> int:
    return c.global_step if c.global_step is not None else c.step


#: the error of the object copies object retention deleted: such a step is never uploaded again
RETIRED = "deleted by object retention"


def to_upload(s: Session, node: str, every: int, limit: int = 4,
              skip: Mapping[int, str | None] | None = None) -> list[StepToUpload]:
    """Verified trained steps (every ``every``-th) with shards of ``node`` not on the tier yet, newest
    first, at most ``limit`` (the loop runs every half second: a few steps per pass, chosen in SQL,
    never a walk over every catalogued row). Steps object retention deleted are not chosen again;
    ``skip``: shard id -> verified digest the caller holds back (refused lately with that digest; a
    new verdict's digest is chosen again), so they never take a step's place."""
    skip = skip or {}
    users_step = func.coalesce(Checkpoint.global_step, Checkpoint.step)
    missing = select(Shard.id).where(
        Shard.checkpoint_id == Checkpoint.id, Shard.node == node, Shard.state == ShardState.VERIFIED.value,
        ~select(ShardCopy.id).where(ShardCopy.checkpoint_id == Shard.checkpoint_id, ShardCopy.rank == Shard.rank,
                                    ShardCopy.tier == _OBJ, ShardCopy.state.in_(_LIVE)).exists())
    for sid, digest in skip.items():  # a handful of shards at most
        missing = missing.where(or_(Shard.id != sid, Shard.digest.is_distinct_from(digest)))
    retired = select(ShardCopy.id).where(ShardCopy.checkpoint_id == Checkpoint.id, ShardCopy.tier == _OBJ,
                                         ShardCopy.state == ShardState.DELETED.value, ShardCopy.error == RETIRED)
    query = select(Checkpoint.id).where(Checkpoint.kind == "trained", Checkpoint.state == StepState.VERIFIED.value,
                                        missing.exists(), ~retired.exists())
    if every > 1:
        query = query.where(users_step % every == 0)
    ids = list(s.execute(query.order_by(Checkpoint.id.desc()).limit(limit)).scalars())
    if not ids:
        return []
    has_copy = select(ShardCopy.id).where(ShardCopy.checkpoint_id == Shard.checkpoint_id, ShardCopy.rank == Shard.rank,
                                          ShardCopy.tier == _OBJ, ShardCopy.state.in_(_LIVE)).exists()
    rows = s.execute(
        select(Checkpoint.id, users_step, Run.name, Run.path, Shard.id, Shard.rank, Shard.path, Shard.size,
               Shard.digest)
        .join(Run, Run.id == Checkpoint.run_id).join(Shard, Shard.checkpoint_id == Checkpoint.id)
        .where(Checkpoint.id.in_(ids), Shard.node == node, Shard.state == ShardState.VERIFIED.value, ~has_copy)
        .order_by(Checkpoint.id.desc(), Shard.rank)).all()
    out: dict[int, StepToUpload] = {}
    for cid, step, run, path, sid, rank, spath, size, digest in rows:
        if sid in skip and skip[sid] == digest:
            continue
        if cid not in out:
            out[cid] = StepToUpload(cid, run, path, step, [])
        out[cid].shards.append((sid, rank, spath, size, digest))
    return list(out.values())


def record_uploaded(s: Session, ckpt_id: int, rank: int, location: str, size: int, digest: str, node: str) -> bool:
    """One rank's object is up and read back; True when this makes every expected rank's object up
    and none committed yet: the caller is the one daemon that writes the manifest (the step's
    row lock orders the daemons recording the step's ranks)."""
    from ckptd.catalog import copies

    ckpt = repo.lock_checkpoint(s, ckpt_id)
    copies.record(s, ckpt_id, rank, Tier.OBJECT, location, state=ShardState.COMPLETE, size=size, digest=digest,
                  node=node)
    return manifest_due(s, ckpt)


def manifest_due(s: Session, ckpt: Checkpoint) -> bool:
    counts = dict(s.execute(select(ShardCopy.state, func.count(func.distinct(ShardCopy.rank))).where(
        ShardCopy.checkpoint_id == ckpt.id, ShardCopy.tier == _OBJ, ShardCopy.state.in_(_LIVE))
        .group_by(ShardCopy.state)).all())
    return not counts.get(ShardState.VERIFIED.value) and ckpt.expected_ranks is not None and \
        counts.get(ShardState.COMPLETE.value, 0) == ckpt.expected_ranks


def uncommitted(s: Session, node: str) -> list[int]:
    """Steps whose objects are all up but whose manifest was never confirmed (a daemon died
    between the last upload and the commit), that ``node`` took part in: it writes the manifest."""
    ids = s.execute(select(ShardCopy.checkpoint_id).where(
        ShardCopy.tier == _OBJ, ShardCopy.node == node, ShardCopy.state == ShardState.COMPLETE.value).distinct()).scalars()
    return [i for i in ids if manifest_due(s, s.get(Checkpoint, i))]


def object_rows(s: Session, ckpt_id: int) -> list[tuple[int, str, int | None, str | None, str]]:
    """(rank, location, size, digest, state) of the step's live object copies."""
    return [tuple(r) for r in s.execute(select(ShardCopy.rank, ShardCopy.location, ShardCopy.size, ShardCopy.digest,
                                               ShardCopy.state).where(
        ShardCopy.checkpoint_id == ckpt_id, ShardCopy.tier == _OBJ, ShardCopy.state.in_(_LIVE))
        .order_by(ShardCopy.rank, ShardCopy.id.desc()))]


@dataclass(frozen=True)
class StepIdentity:
    run: str
    run_path: str
    layout: str
    prefix: str
    epoch: int
    name_step: int
    step: int
    global_step: int | None
    incarnation: int | None
    world_size: int | None
    strategy_path: str | None
    strategy_hash: str | None


def identity(s: Session, ckpt_id: int) -> StepIdentity:
    c = s.get(Checkpoint, ckpt_id)
    run = s.get(Run, c.run_id)
    strat = s.get(StrategyFile, c.strategy_id) if c.strategy_id else None
    return StepIdentity(run.name, run.path, run.layout, c.prefix, c.epoch, c.step, _users_step(c), c.global_step,
                        c.incarnation, c.expected_ranks, strat.path if strat else None,
                        strat.content_hash if strat else None)


def commit(s: Session, ckpt_id: int) -> int:
    """The manifest is written: the step's object copies are verified (bumps the resume generation)."""
    return s.execute(update(ShardCopy).where(
        ShardCopy.checkpoint_id == ckpt_id, ShardCopy.tier == _OBJ, ShardCopy.state == ShardState.COMPLETE.value)
        .values(state=ShardState.VERIFIED.value, verified_at=utcnow())).rowcount


def due_for_scrub(s: Session, node: str, older_than, limit: int) -> list[tuple[int, int, str, int, str]]:  # noqa: ANN001
    """(step id, rank, location, size, digest) of ``node``'s verified object copies last checked
    before ``older_than``, oldest first."""
    return [tuple(r) for r in s.execute(select(
        ShardCopy.checkpoint_id, ShardCopy.rank, ShardCopy.location, ShardCopy.size, ShardCopy.digest).where(
        ShardCopy.tier == _OBJ, ShardCopy.node == node, ShardCopy.state == ShardState.VERIFIED.value,
        ShardCopy.verified_at < older_than).order_by(ShardCopy.verified_at).limit(limit))]


def set_verdict(s: Session, ckpt_id: int, location: str, state: ShardState, error: str | None) -> None:
    s.execute(update(ShardCopy).where(ShardCopy.checkpoint_id == ckpt_id, ShardCopy.tier == _OBJ,
                                      ShardCopy.location == location).values(
        state=state.value, error=error, verified_at=utcnow()))


def runs_on_tier(s: Session) -> list[tuple[int, str]]:
    """(run id, name) of runs with verified object copies."""
    return [tuple(r) for r in s.execute(select(Run.id, Run.name).where(select(ShardCopy.id).join(
        Checkpoint, Checkpoint.id == ShardCopy.checkpoint_id).where(
        Checkpoint.run_id == Run.id, ShardCopy.tier == _OBJ, ShardCopy.state == ShardState.VERIFIED.value).exists()))]


def drop_step(s: Session, ckpt_id: int) -> bool:
    """The step's objects are deleted: its object rows go, and the step's own rows too when no
    file or other copy holds it any more. True when the step is gone entirely."""
    from ckptd.catalog import copies, removal

    s.execute(update(ShardCopy).where(ShardCopy.checkpoint_id == ckpt_id, ShardCopy.tier == _OBJ)
              .values(state=ShardState.DELETED.value))
    if copies.orphans(s, [ckpt_id]) or s.get(Checkpoint, ckpt_id).state == StepState.DELETED.value and not \
            s.execute(select(ShardCopy.id).where(ShardCopy.checkpoint_id == ckpt_id,
                                                 ShardCopy.state != ShardState.DELETED.value)).first():
        removal.delete_checkpoint_rows(s, ckpt_id)
        return True
    return False


def files_gone_keep(s: Session, ckpt_id: int) -> bool:
    """File retention removed the step's files: when it is whole on the object tier its rows stay
    (state ``deleted``, its object copies untouched) and this returns True."""
    from ckptd.catalog import copies

    c = s.get(Checkpoint, ckpt_id)
    if not copies.whole_on(s, c, Tier.OBJECT):
        return False
    c.state = StepState.DELETED.value
    c.reason = "files removed by retention; whole on the object tier"
    return True


def set_verdict_all(s: Session, ckpt_id: int, state: ShardState, error: str | None) -> None:
    s.execute(update(ShardCopy).where(ShardCopy.checkpoint_id == ckpt_id, ShardCopy.tier == _OBJ,
                                      ShardCopy.state.in_(_LIVE)).values(state=state.value, error=error))


def files_verified_at(s: Session, ckpt_id: int):  # noqa: ANN201 - datetime | None
    """When the step's last shard file was verified (the start of the delay to its manifest)."""
    from ckptd.catalog.models import as_utc

    at = s.execute(select(func.max(Shard.verified_at)).where(Shard.checkpoint_id == ckpt_id)).scalar()
    return as_utc(at) if at is not None else None
