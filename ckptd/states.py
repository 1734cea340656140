"""The lifecycle states of shards and checkpoint steps, and what each one promises.

Shard (one rank's file of one step)::

    complete ──verify──▶ verified
        │                  │ (file changed / re-verify fails)
        ├──────────▶ corrupt ◀┘        quarantined in place, reason stored, never deleted by ckptd
        ├──── file vanished ──▶ deleted (row kept for history)
        └──── step re-saved under a newer layout, this file was not ──▶ superseded

A shard row exists only for a file at its final name (``*.tmp`` is never catalogued). ``complete``
= final name, size stable, record structure parses. ``verified`` = CRC / decryption /
authentication passed and the size+digest recorded at ingest still match. ``superseded`` = the
file belongs to a save of its step under an older strategy that the job has since re-saved under
a newer one (see *Layout changes* below); the row is kept for history with the reason, the file
is left on disk untouched. Any later rewrite of the file makes it an ordinary shard again
(``complete``) of the step as it is now.

Checkpoint step (all ranks of one save)::

    incomplete ─▶ pending ─▶ verified ─▶ (restorable)
                     └──▶ corrupt          deleted (any shard deleted after the fact)

``incomplete`` = some expected rank has no shard yet (in a run that allows subset saves: the
files present do not cover the layout); ``pending`` = every rank present, not all
verified; ``verified`` = every shard verified and the step-level checks passed (ranks exactly
once, one global step, shapes match the strategy, replicas agree); ``corrupt`` = a shard or a
step-level check failed; ``deleted`` = a shard file disappeared (rotation or an operator);
``deleting`` = ckptd's retention is removing it (sticky until the rows are gone);
``superseded`` = only on the history rows described below, never on a step of the run.
A step is *restorable* only in ``verified``.

Layout changes. A job restarted on another parallel layout rewrites its strategy file and
resumes from an older step, so it saves again steps the old layout had saved: files of ranks in
both layouts are overwritten in place, files of ranks only the old layout had stay on disk. The
rule (:func:`layout_resave`): a step bound to strategy *O* whose strategy file now holds another
layout *N* (same file, newer content) was **re-saved under N** iff at least one of its shard files
was written at or after N appeared — file mtime ≥ the strategy file's mtime when ckptd first saw
that content, both read from the same filesystem, so no clock of ckptd's is compared with the
trainer's — and that shard's rank exists in N's world. The trainer writes its strategy file before
its first save, so a file written after it is the new job's; a step the new job never saved has
no such file and keeps O (it stays restorable under the layout it was saved with). A re-saved
step is re-bound to N (``expected_ranks`` = N's world size, step checks run again under N), and
its shards written before N appeared are moved, as ``superseded``, to a history row of the step
(``kind = 'superseded'``, ``layout`` = O's hash, bound to O, state ``superseded``) that neither
the resume oracle nor retention's plans ever see (they read ``trained`` steps). The step is then
``incomplete`` until every rank of N has arrived, and ``verified`` once they pass the checks.
Retention deleting a step deletes its history rows and their files with it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Hashable, Mapping

from ckptd import runlayout


class ShardState(str, enum.Enum):
    COMPLETE = "complete"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    DELETED = "deleted"
    SUPERSEDED = "superseded"  # left over from a save under an older layout; not part of the step


#: verdicts that say more about the configuration (key, policies) than about the file
CONFIG_ERROR_CODES = ("key_required", "not_encrypted", "invalid_key", "wrong_key", "policy", "mode_mismatch")


def awaits_verification(state: str, stamp: str | None, error_code: str | None, stamp_now: str) -> bool:
    """Whether a shard still needs a verdict from a daemon whose configuration stamp is
    ``stamp_now`` (``Settings.verification_stamp``): it has none yet, or its verdict was given
    under another configuration (key, CRC/encryption policy) and is not trusted — rows from
    before stamps: when their verdict was a configuration error. Deleted and superseded shards
    need none."""
    if state == ShardState.COMPLETE.value:
        return True
    if state not in (ShardState.VERIFIED.value, ShardState.CORRUPT.value):
        return False
    return error_code in CONFIG_ERROR_CODES if stamp is None else stamp != stamp_now


class StepState(str, enum.Enum):
    INCOMPLETE = "incomplete"
    PENDING = "pending"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    DELETED = "deleted"
    DELETING = "deleting"  # retention is removing it (two-phase; finished on restart)
    SUPERSEDED = "superseded"  # a history row: what an older layout's save of a step left behind


class Tier(str, enum.Enum):
    """Where a copy of a shard lives (``shard_copies.tier``). The file tier's copy of a shard is the
    shard row itself (``shards.path``, ``shards.state``): every shard has one, the hot ingest and
    verification paths write only that row, and a second row per file would double their writes
    for no new fact. The other tiers hold rows in ``shard_copies``; their states are
    :class:`ShardState` values with the same promises (``verified`` = the copy's bytes were checked)."""

    FILE = "file"
    MEMORY = "memory"  # a committed slot in a node's shared memory (flash checkpoints)
    OBJECT = "object"  # objects in S3-compatible storage, committed by a per-step manifest


#: ``checkpoints.kind`` of the history rows that hold superseded shards
SUPERSEDED_KIND = "superseded"
#: kinds of steps a trainer saves (and may save again under a newer layout)
RESAVABLE_KINDS = ("trained", "breakpoint")


def allows_subset(run_layout: str | None) -> bool:
    """Runs whose steps may be whole without every rank's own file: their layout says so
    (:attr:`ckptd.runlayout.RunLayout.allows_subset`, with the reason in its module)."""
    return runlayout.by_name(run_layout).allows_subset


def step_state(
    expected_ranks: int | None, shard_states: dict[int, ShardState], step_checks_ok: bool | None, subset: bool = False
) -> StepState:
    """Derive a step's state from its shards (pure; table-tested). Superseded shards are not
    part of the step and are ignored.

    ``step_checks_ok`` is None until the step-level checks ran (they run once all shards verified).
    """
    live = {rank: st for rank, st in shard_states.items() if st != ShardState.SUPERSEDED}
    return step_state_from(expected_ranks, len(live), set(live.values()), step_checks_ok, subset)


def step_state_from(
    expected_ranks: int | None, ranks_present: int, states: set[ShardState], step_checks_ok: bool | None,
    subset: bool = False,
) -> StepState:
    """The same decision from aggregates (what the catalog computes in SQL for 512-rank steps);
    the caller counts only the step's own shards (never superseded ones).

    ``subset``: the step may be whole without every rank's file (MindFormers' remove_redundancy
    and dying-gasp saves, see :mod:`ckptd.service.stepcheck`): with ranks missing, its step checks
    (a coverage check) run once the files present are verified; if they find slices nobody holds
    the step is ``incomplete`` — not ``corrupt``, the missing files may still arrive."""
    states = states - {ShardState.SUPERSEDED}
    if ShardState.DELETED in states:
        return StepState.DELETED
    short = expected_ranks is None or ranks_present < expected_ranks
    if short and subset and expected_ranks is not None and ranks_present and ShardState.CORRUPT not in states:
        if states != {ShardState.VERIFIED} or step_checks_ok is False:
            return StepState.INCOMPLETE
        return StepState.VERIFIED if step_checks_ok else StepState.PENDING
    if ShardState.CORRUPT in states or step_checks_ok is False:
        return StepState.CORRUPT
    if short:
        return StepState.INCOMPLETE
    if states == {ShardState.VERIFIED} and step_checks_ok:
        return StepState.VERIFIED
    return StepState.PENDING


@dataclass(frozen=True)
class Resave:
    """A step re-saved under a newer layout: its shards that belong to the new save, and the rest."""

    kept: frozenset[Hashable]
    superseded: frozenset[Hashable]


def layout_resave(
    bound_hash: str | None,
    current_hash: str | None,
    current_world: int,
    appeared_ns: int | None,
    shards: Mapping[Hashable, tuple[int, int]],
) -> Resave | None:
    """Was this step re-saved under the layout its strategy file holds now? (pure; table-tested)

    ``bound_hash``: the strategy the step is bound to; ``current_hash`` / ``current_world``: what
    that strategy file holds now; ``appeared_ns``: the file's mtime when ckptd first saw that
    content; ``shards``: key -> (rank, file mtime_ns) of the step's shard rows. None = not
    re-saved, the step keeps its binding. A shard of a rank outside the new world can never be
    the new layout's, whatever its mtime says (a ``touch`` of an old file must not re-bind)."""
    if bound_hash is None or current_hash is None or appeared_ns is None or bound_hash == current_hash:
        return None
    kept = frozenset(k for k, (rank, mtime_ns) in shards.items() if mtime_ns >= appeared_ns and rank < current_world)
    if not kept:
        return None
    return Resave(kept, frozenset(shards) - kept)
