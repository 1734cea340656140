"""Pure policies (no I/O, table-tested): which step to resume from, and which steps to keep.

Like Orbax's policies these are small frozen objects evaluated over plain data; the service layer
loads the data from the catalog and acts on the decision.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Sequence


@dataclass(frozen=True)
class StepInfo:
    """What the policies need to know about one checkpoint step."""

    id: int
    step: int  # training step (global step when known, else the step in the file name)
    state: str  # a StepState value
    reason: str | None = None
    marked_bad: bool = False
    bad_reason: str | None = None
    pinned: bool = False
    in_use: bool = False  # leased by a resume answer or a running conversion
    health_reason: str | None = None  # the job's own health record calls the save abnormal
    #: training order when ``step`` cannot tell: (epoch, step in the file name, incarnation) — a step
    #: not verified yet has no global step, and two incarnations can save the same one (the newer wins)
    position: tuple[int, ...] = ()
    #: how the file names call a step whose global step is not known yet, when that is not the
    #: training step (MindFormers counts ``S`` within the epoch): said with the reason it is skipped
    named: str | None = None


@dataclass(frozen=True)
class Health:
    step: int
    loss: float | None
    grad_norm: float | None = None
    overflow: bool = False


# --- training health ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SpikeRule:
    """A loss spike: loss > ``factor`` x the median of the previous ``window`` finite losses.

    Needs at least ``min_history`` earlier losses, so warm-up noise never counts as a spike.
    """

    factor: float = 3.0
    window: int = 20
    min_history: int = 5

    def first_spike(self, history: Sequence[Health]) -> tuple[int, str] | None:
        finite: list[float] = []
        for h in history:
            if h.loss is None or not math.isfinite(h.loss):
                continue
            recent = finite[-self.window :]
            if len(recent) >= self.min_history:
                median = statistics.median(recent)
                if median > 0 and h.loss > self.factor * median:
                    return h.step, f"loss spike at step {h.step}: {h.loss:.4g} > {self.factor:g} x median {median:.4g}"
            finite.append(h.loss)
        return None


def first_unhealthy(history: Iterable[Health], spike: SpikeRule | None) -> tuple[int, str] | None:
    """The first step from which training state is suspect (NaN/inf loss, or a spike if asked)."""
    ordered = sorted(history, key=lambda h: h.step)
    for h in ordered:
        if h.loss is not None and not math.isfinite(h.loss):
            nan = (h.step, f"loss is {h.loss} at step {h.step}")
            break
    else:
        nan = None
    spiked = spike.first_spike(ordered) if spike else None
    candidates = [c for c in (nan, spiked) if c is not None]
    return min(candidates) if candidates else None


# --- resume ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumeDecision:
    chosen: StepInfo | None
    skipped: tuple[tuple[int, str], ...]
    #: skipped steps ckptd has not finished judging (``pending``): they may still become restorable,
    #: so "nothing restorable" is no verdict on them yet (the launcher must not start from zero)
    unjudged: tuple[int, ...] = ()


_STATE_REASONS = {
    "incomplete": "incomplete: not every rank's shard is present",
    "pending": "pending: verification has not finished",
    "deleted": "deleted: a shard file is gone",
    "deleting": "being deleted by retention",
}


@dataclass(frozen=True)
class ResumePolicy:
    """Newest fully verified step, skipping what an operator or training health rules out."""

    max_step: int | None = None
    spike: SpikeRule | None = None

    def decide(self, steps: Iterable[StepInfo], health: Iterable[Health] = ()) -> ResumeDecision:
        unhealthy = first_unhealthy(health, self.spike)
        skipped: list[tuple[int, str]] = []
        unjudged: list[int] = []
        for s in sorted(steps, key=lambda s: s.position or (s.step,), reverse=True):
            if self.max_step is not None and s.step > self.max_step:
                continue  # asked for "at or before N": newer steps are not candidates, not failures
            reason = self._rejection(s, unhealthy)
            if reason is None:
                return ResumeDecision(s, tuple(skipped), tuple(unjudged))
            skipped.append((s.step, reason if s.named is None else f"{reason} ({s.named})"))
            if s.state == "pending" and not s.marked_bad:
                unjudged.append(s.step)
        return ResumeDecision(None, tuple(skipped), tuple(unjudged))

    @staticmethod
    def _rejection(s: StepInfo, unhealthy: tuple[int, str] | None) -> str | None:
        if s.marked_bad:
            return "marked bad by an operator" + (f": {s.bad_reason}" if s.bad_reason else "")
        if s.state == "corrupt":
            return "corrupt: " + (s.reason or "a shard failed verification")
        if s.state == "incomplete" and s.reason:
            return f"incomplete: {s.reason}"  # which files are missing, when the catalog knows
        if s.state != "verified":
            return _STATE_REASONS.get(s.state, s.state)
        if s.health_reason:
            return f"unhealthy: {s.health_reason}"
        if unhealthy is not None and s.step >= unhealthy[0]:
            return f"unhealthy: {unhealthy[1]}"
        return None


# --- retention ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetentionPlan:
    keep: dict[int, str] = field(default_factory=dict)  # step id -> why it is kept
    delete: tuple[int, ...] = ()


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` restorable steps, every ``keep_every``-th step, pinned steps.

    Steps are taken in training order (``position`` when known, else ``step``). *Restorable*: verified
    and not marked bad. *May still become restorable*: ``pending`` (its verification has not
    finished, e.g. everything after a restart that re-verifies) or ``incomplete`` (ranks still
    arriving), and not marked bad.

    A step that may still become restorable is kept exactly where it would be kept if it were
    restorable now, the other such steps not counted: while fewer than ``keep_last`` restorable
    steps are newer than it (so it would be one of the newest ``keep_last``), when ``keep_every``
    divides its step (marked bad or not, as for a verified step), and when pinned or leased. It
    never takes the place of a restorable step: counting it among the newest ``keep_last`` would
    delete verified steps on the guess that it passes, and a guess that fails leaves fewer
    restorable steps than asked for. So a plan made while steps are unsettled deletes nothing
    that the plan made after they settle (each verified or not) would keep: steps that may still
    become restorable are never deleted ahead of older restorable ones, and storage never exceeds
    what the policy keeps once every one of them verified. (``keep_last=5``, steps 1000 and
    996-990 verified, 999-997 pending again after a restart that re-verifies: 999-997 are kept
    with 1000 and 996-993, and 992-990 go. The previous rule counted only what was verified at
    that moment: it deleted 999-997 and kept 994-993.)

    Invariants, whatever the numbers: the newest restorable step is never deleted; nothing newer
    than it that may still become restorable is deleted; corrupt or marked-bad steps newer than it
    are kept as evidence; pinned and leased steps are kept.
    """

    keep_last: int | None = 5
    keep_every: int | None = None

    def plan(self, steps: Iterable[StepInfo]) -> RetentionPlan:
        ordered = sorted(steps, key=_training_order, reverse=True)
        restorable = [s for s in ordered if s.state == "verified" and not s.marked_bad]
        n = max(self.keep_last, 1) if self.keep_last is not None else None
        window = restorable[:n] if n is not None else restorable
        keep: dict[int, str] = {}
        for s in window:
            keep[s.id] = f"one of the newest {n} restorable" if n is not None else "keep_last unset: restorable steps are kept"
        if restorable:
            keep[restorable[0].id] = "newest restorable step"
        newest_ok = _training_order(restorable[0]) if restorable else None
        # a step newer than this (the oldest of the newest n restorable) would be one of the newest n
        # if it became restorable; None: fewer than n restorable steps, so any step would be
        floor = _training_order(window[-1]) if n is not None and len(restorable) >= n else None
        for s in ordered:
            if s.id in keep or s.state == "deleting":
                continue
            at = _training_order(s)
            unsettled = s.state in _MAY_BECOME_RESTORABLE
            maybe = unsettled and not s.marked_bad
            if s.pinned:
                keep[s.id] = "pinned"
            elif s.in_use:
                keep[s.id] = "in use by a resume or conversion"
            elif self.keep_every and s.step % self.keep_every == 0 and (s.state == "verified" or unsettled):
                keep[s.id] = f"every {self.keep_every}th step" + ("" if s.state == "verified" else "; may still become restorable")
            elif maybe and (newest_ok is None or at > newest_ok):
                keep[s.id] = "newer than the newest restorable step; may still become restorable"
            elif maybe and (floor is None or at > floor):
                keep[s.id] = f"{s.state}: may still become restorable, and would then be one of the newest {n} restorable"
            elif newest_ok is None or at > newest_ok:
                if s.marked_bad:
                    keep[s.id] = "newer than the newest restorable step; marked bad, kept as evidence"
                elif s.state == "corrupt":
                    keep[s.id] = "newer than the newest restorable step; kept as evidence"
        delete = tuple(s.id for s in ordered if s.id not in keep and s.state != "deleting")
        return RetentionPlan(keep, delete)


#: step states that may still turn into ``verified`` without anyone's intervention
_MAY_BECOME_RESTORABLE = ("pending", "incomplete")


def _training_order(s: StepInfo) -> tuple[int, ...]:
    """Training order, as the resume policy sees it: a step not verified yet has no global step
    (a MindFormers name counts within its epoch), so ``position`` decides when it is known."""
    return s.position or (s.step,)
