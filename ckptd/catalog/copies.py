"""The table of copies: every copy of a shard on every tier (``ckptd.states.Tier``).

A tier is a storage backend plus rows here; the memory and object tiers add rows, not code paths.
The file tier's copy of a shard is the shard row itself (why: ``Tier``'s docstring), so the reads
below put it next to the other tiers' rows and callers see one list of copies per shard.
Copies are keyed by step and rank, not by shard row: a memory snapshot of a step the job never saved
to files has none. A step is *whole on a tier* when every one of its expected ranks has a verified
copy there; on the file tier that is the step's own verdict (``verified``: the step checks passed too).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple
from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from ckptd.catalog import repo
from ckptd.catalog.models import Checkpoint, Shard, ShardCopy, utcnow
from ckptd.states import ShardState, StepState, Tier
from ckptd.storage import file_uri


@dataclass(frozen=True)
class Copy:
    """One copy of one rank's shard of a step: where it is and what ckptd knows of it."""

    rank: int
    tier: Tier
    location: str
    state: str
    size: int | None
    digest: str | None
    node: str | None
    error: str | None = None
    verified_at: datetime | None = None


def file_copy(sh: Shard) -> Copy:
    """The file tier's copy of a shard: the shard row, its path as a URI."""
    return Copy(sh.rank, Tier.FILE, file_uri(sh.path), sh.state, sh.size, sh.digest, sh.node, sh.error, sh.verified_at)


def _of_row(r: ShardCopy) -> Copy:
    return Copy(r.rank, Tier(r.tier), r.location, r.state, r.size, r.digest, r.node, r.error, r.verified_at)


def record(s: Session, ckpt_id: int, rank: int, tier: Tier, location: str, *, state: ShardState,
           size: int | None = None, digest: str | None = None, node: str | None = None,
           error: str | None = None) -> None:
    """Record (or update) the copy of step ``ckpt_id``'s rank ``rank`` at ``location`` on ``tier``
    (not the file tier: its copy is the shard row). Race-free between daemons: an insert that loses
    to another's becomes an update of the row that won."""
    if tier is Tier.FILE:
        raise ValueError("the file tier's copy is the shard row itself; record it through ingest")
    values = {"state": state.value, "size": size, "digest": digest, "node": node, "error": error,
              "verified_at": utcnow() if state is ShardState.VERIFIED else None}
    key = {"checkpoint_id": ckpt_id, "rank": rank, "tier": tier.value, "location": location}
    if not repo.insert_ignore(s, ShardCopy, {**key, **values, "created_at": utcnow()}, list(key)):
        s.execute(update(ShardCopy).where(*(getattr(ShardCopy, k) == v for k, v in key.items())).values(**values))


def set_state(s: Session, ckpt_id: int, rank: int, tier: Tier, location: str, state: ShardState,
              error: str | None = None) -> int:
    """A copy's new verdict (a scrub, a vanished slot or object); the number of rows changed."""
    return s.execute(update(ShardCopy).where(
        ShardCopy.checkpoint_id == ckpt_id, ShardCopy.rank == rank, ShardCopy.tier == tier.value,
        ShardCopy.location == location).values(
        state=state.value, error=error, verified_at=utcnow() if state is ShardState.VERIFIED else None)).rowcount


def of_step(s: Session, ckpt_id: int, shards: list[Shard]) -> dict[int, list[Copy]]:
    """Every copy of each rank of a step: the file tier's (its live shard rows) first, then the
    other tiers' by tier and location."""
    out: dict[int, list[Copy]] = defaultdict(list)
    for sh in sorted(shards, key=lambda x: (x.rank, x.path)):
        if sh.state != ShardState.SUPERSEDED.value:
            out[sh.rank].append(file_copy(sh))
    rows = s.execute(select(ShardCopy).where(ShardCopy.checkpoint_id == ckpt_id)
                     .order_by(ShardCopy.rank, ShardCopy.tier, ShardCopy.location)).scalars()
    for r in rows:
        out[r.rank].append(_of_row(r))
    return dict(out)


def whole_tiers(s: Session, steps: list[Checkpoint]) -> dict[int, list[Tier]]:
    """For each step, the tiers it is whole on (file first): one grouped query for all of them.
    Off the file tier a step is whole when every rank 0..``expected_ranks``-1 has a verified copy."""
    out: dict[int, list[Tier]] = {c.id: [Tier.FILE] if c.state == StepState.VERIFIED.value else [] for c in steps}
    expected = {c.id: c.expected_ranks for c in steps}
    if not out:
        return out
    # the rule of whole_steps_on: ranks 0..expected-1 each verified (a stray rank number never
    # makes up for a missing one, so the listing and the oracle agree)
    held = s.execute(
        select(ShardCopy.checkpoint_id, ShardCopy.tier, func.count(func.distinct(ShardCopy.rank)))
        .join(Checkpoint, Checkpoint.id == ShardCopy.checkpoint_id)
        .where(ShardCopy.checkpoint_id.in_(list(out)), ShardCopy.state == ShardState.VERIFIED.value,
               ShardCopy.rank >= 0, ShardCopy.rank < Checkpoint.expected_ranks)
        .group_by(ShardCopy.checkpoint_id, ShardCopy.tier)).all()
    extra: dict[int, list[Tier]] = defaultdict(list)
    for ckpt, tier, n in held:
        if expected[ckpt] is not None and n == expected[ckpt]:
            extra[ckpt].append(Tier(tier))
    for ckpt, tiers in extra.items():
        out[ckpt].extend(sorted(tiers, key=list(Tier).index))
    return out


def whole_on(s: Session, ckpt: Checkpoint, tier: Tier) -> bool:
    """Whether step ``ckpt`` is whole on ``tier`` (not the file tier): the rule of
    :func:`whole_steps_on` and :func:`whole_tiers`, every rank 0..expected-1 with a verified copy."""
    held = set(s.execute(select(ShardCopy.rank).where(
        ShardCopy.checkpoint_id == ckpt.id, ShardCopy.tier == tier.value,
        ShardCopy.state == ShardState.VERIFIED.value)).scalars())
    return ckpt.expected_ranks is not None and set(range(ckpt.expected_ranks)) <= held


def delete_of_step(s: Session, ckpt_id: int) -> None:
    """The copy rows of a step whose rows go (retention deletes them before the step's row)."""
    s.execute(delete(ShardCopy).where(ShardCopy.checkpoint_id == ckpt_id))


# --- the memory tier's rows (ckptd.service.memtier) ------------------------------------------------


def step_for_copy(s: Session, run_name: str, run_path: str, prefix: str, epoch: int, step: int,
                  incarnation: int | None, world_size: int) -> Checkpoint:
    """The trained step a copy of another tier belongs to, created as ingest would create it for
    its first file (a memory snapshot usually comes before any file, and most never get one)."""
    run = repo.get_or_create_run(s, run_name, run_path)
    ckpt = repo.get_or_create_checkpoint(s, run, prefix, epoch, step, "trained", world_size)
    if ckpt.incarnation is None and incarnation is not None:
        ckpt.incarnation = incarnation
    if ckpt.expected_ranks is None:
        ckpt.expected_ranks = world_size
    return ckpt


def live_on_node(s: Session, tier: Tier, node: str) -> list[tuple[int, int, str, str | None]]:
    """(step id, rank, location, digest) of ``node``'s copies on ``tier`` not known gone."""
    return [tuple(r) for r in s.execute(select(
        ShardCopy.checkpoint_id, ShardCopy.rank, ShardCopy.location, ShardCopy.digest).where(
        ShardCopy.tier == tier.value, ShardCopy.node == node, ShardCopy.state != ShardState.DELETED.value))]


def set_state_at(s: Session, tier: Tier, location: str, state: ShardState, error: str | None = None,
                 *, except_step: int | None = None) -> list[int]:
    """Every live copy at ``location`` (a slot holds one snapshot at a time) gets ``state``; the
    steps they belonged to."""
    q = select(ShardCopy.id, ShardCopy.checkpoint_id).where(
        ShardCopy.tier == tier.value, ShardCopy.location == location, ShardCopy.state != state.value)
    if except_step is not None:
        q = q.where(ShardCopy.checkpoint_id != except_step)
    rows = s.execute(q).all()
    if rows:
        s.execute(update(ShardCopy).where(ShardCopy.id.in_([r[0] for r in rows])).values(state=state.value, error=error))
    return sorted({r[1] for r in rows})


def orphans(s: Session, ckpt_ids: list[int]) -> list[int]:
    """Of ``ckpt_ids``, the steps nothing holds any more: no shard row, no copy that is not gone,
    not pinned, marked or leased (a memory snapshot's step whose slot was overwritten)."""
    if not ckpt_ids:
        return []
    has_shard = select(Shard.id).where(Shard.checkpoint_id == Checkpoint.id).exists()
    has_copy = select(ShardCopy.id).where(ShardCopy.checkpoint_id == Checkpoint.id,
                                          ShardCopy.state != ShardState.DELETED.value).exists()
    return list(s.execute(select(Checkpoint.id).where(
        Checkpoint.id.in_(ckpt_ids), ~has_shard, ~has_copy, Checkpoint.pinned.is_(False),
        Checkpoint.marked_bad.is_(False), Checkpoint.lease_until.is_(None))).scalars())


class WholeCopy(NamedTuple):
    """One rank's verified copy of a step that is whole on a tier."""

    rank: int
    location: str
    node: str | None
    digest: str | None  # xxh3-128 the daemon computed when it verified the copy


def whole_steps(s: Session, run_id: int, tier: Tier, unreachable: set[str]) -> dict[int, list[WholeCopy]]:
    """The run's steps whole on ``tier`` from reachable nodes: step id -> one verified copy per
    expected rank, in rank order (the newest row where a rank has several)."""
    return whole_steps_on(s, run_id, (tier,), unreachable).get(tier, {})


def whole_steps_on(s: Session, run_id: int, tiers: tuple[Tier, ...], unreachable: set[str],
                   ) -> dict[Tier, dict[int, list[WholeCopy]]]:
    """:func:`whole_steps` of several tiers in one query (the resume oracle asks for memory and
    objects on every computed answer). Only memory copies depend on their node being reachable."""
    if not tiers:
        return {}
    rows = s.execute(
        select(ShardCopy.tier, ShardCopy.checkpoint_id, ShardCopy.rank, ShardCopy.location, ShardCopy.node,
               ShardCopy.digest, Checkpoint.expected_ranks)
        .join(Checkpoint, Checkpoint.id == ShardCopy.checkpoint_id)
        .where(Checkpoint.run_id == run_id, ShardCopy.tier.in_([t.value for t in tiers]),
               ShardCopy.state == ShardState.VERIFIED.value)
        .order_by(ShardCopy.tier, ShardCopy.checkpoint_id, ShardCopy.rank, ShardCopy.id.desc())).all()
    held: dict[tuple[str, int], dict[int, WholeCopy]] = defaultdict(dict)
    expected: dict[int, int | None] = {}
    for tier, ckpt, rank, loc, node, digest, world in rows:
        if tier == Tier.MEMORY.value and node in unreachable:
            continue
        held[(tier, ckpt)].setdefault(rank, WholeCopy(rank, loc, node, digest))
        expected[ckpt] = world
    out: dict[Tier, dict[int, list[WholeCopy]]] = defaultdict(dict)
    for (tier, ckpt), by_rank in held.items():
        if expected[ckpt] is not None and set(range(expected[ckpt])) <= by_rank.keys():
            out[Tier(tier)][ckpt] = [by_rank[r] for r in range(expected[ckpt])]
    return dict(out)
