"""The lifecycle states of shards and checkpoint steps, and what each one promises.

Shard (one rank's file of one step)::

    complete ──verify──▶ verified
        │                  │ (file changed / re-verify fails)
        ├──────────▶ corrupt ◀┘        quarantined in place, reason stored, never deleted by ckptd
        └──── file vanished ──▶ deleted (row kept for history)

A shard row exists only for a file at its final name (``*.tmp`` is never catalogued). ``complete``
= final name, size stable, record structure parses. ``verified`` = CRC / decryption /
authentication passed and the size+digest recorded at ingest still match.

Checkpoint step (all ranks of one save)::

    incomplete ─▶ pending ─▶ verified ─▶ (restorable)
                     └──▶ corrupt          deleted (any shard deleted after the fact)

``incomplete`` = some expected rank has no shard yet; ``pending`` = every rank present, not all
verified; ``verified`` = every shard verified and the step-level checks passed (ranks exactly
once, one global step, shapes match the strategy, replicas agree); ``corrupt`` = a shard or a
step-level check failed; ``deleted`` = a shard file disappeared (rotation or an operator);
``deleting`` = ckptd's retention is removing it (sticky until the rows are gone).
A step is *restorable* only in ``verified``.
"""

from __future__ import annotations

import enum


class ShardState(str, enum.Enum):
    COMPLETE = "complete"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    DELETED = "deleted"


class StepState(str, enum.Enum):
    INCOMPLETE = "incomplete"
    PENDING = "pending"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    DELETED = "deleted"
    DELETING = "deleting"  # retention is removing it (two-phase; finished on restart)


def step_state(expected_ranks: int | None, shard_states: dict[int, ShardState], step_checks_ok: bool | None) -> StepState:
    """Derive a step's state from its shards (pure; table-tested).

    ``step_checks_ok`` is None until the step-level checks ran (they run once all shards verified).
    """
    return step_state_from(expected_ranks, len(shard_states), set(shard_states.values()), step_checks_ok)


def step_state_from(
    expected_ranks: int | None, ranks_present: int, states: set[ShardState], step_checks_ok: bool | None
) -> StepState:
    """The same decision from aggregates (what the catalog computes in SQL for 512-rank steps)."""
    if ShardState.DELETED in states:
        return StepState.DELETED
    if ShardState.CORRUPT in states or step_checks_ok is False:
        return StepState.CORRUPT
    if expected_ranks is None or ranks_present < expected_ranks:
        return StepState.INCOMPLETE
    if states == {ShardState.VERIFIED} and step_checks_ok:
        return StepState.VERIFIED
    return StepState.PENDING
