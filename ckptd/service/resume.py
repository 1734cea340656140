"""The resume oracle: what a launcher is told after a failure.

Loads the run's steps and training health from the catalog, lets :class:`ckptd.policy.ResumePolicy`
choose, and answers with everything a relaunch needs. The chosen step is leased for a while so
retention cannot delete it between the answer and the restarted job loading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ckptd.catalog.models import Checkpoint, Shard, StepHealth, StrategyFile
from ckptd.errors import CkptdError
from ckptd.policy import Health, ResumePolicy, SpikeRule, StepInfo
from ckptd.service.catalog import get_run
from ckptd.states import ShardState

RESUME_LEASE = timedelta(minutes=30)


class NoRestorableStepError(CkptdError):
    code = "no_restorable_step"
    default_hint = "nothing verified to resume from: start fresh only if that is intended (launcher --allow-fresh)"


@dataclass(frozen=True)
class ResumeOptions:
    max_step: int | None = None
    world_size: int | None = None  # target layout: a different world size needs a conversion
    skip_spikes: bool = False
    spike_factor: float = 3.0
    spike_window: int = 20
    lease: bool = True


def step_infos(s: Session, run_id: int, now: datetime, limit: int | None = None) -> list[StepInfo]:
    """The run's trained steps, newest first (plain column rows: this is the oracle's hot path)."""
    q = (
        select(Checkpoint.id, Checkpoint.step, Checkpoint.global_step, Checkpoint.state, Checkpoint.reason,
               Checkpoint.marked_bad, Checkpoint.bad_reason, Checkpoint.pinned, Checkpoint.lease_until)
        .where(Checkpoint.run_id == run_id, Checkpoint.kind == "trained")
        .order_by(Checkpoint.epoch.desc(), Checkpoint.step.desc())
    )
    if limit is not None:
        q = q.limit(limit)
    return [
        StepInfo(
            id=cid,
            step=gstep if gstep is not None else step,
            state=state,
            reason=reason,
            marked_bad=bool(bad),
            bad_reason=bad_reason,
            pinned=bool(pinned),
            in_use=lease is not None and _aware(lease) > now,
        )
        for cid, step, gstep, state, reason, bad, bad_reason, pinned, lease in s.execute(q).all()
    ]


_FIRST_BATCH = 64  # the answer is almost always among the newest few steps


def _health(s: Session, run_id: int, spikes: bool) -> list[Health]:
    """What the policy needs: without spike detection only the first non-finite loss matters."""
    if spikes:
        from ckptd.service.catalog import health_rows

        return [Health(step, loss, gn, bool(ov)) for step, loss, gn, ov in health_rows(s, run_id)]
    first = s.execute(
        select(StepHealth.step, StepHealth.loss_nonfinite)
        .where(StepHealth.run_id == run_id, StepHealth.loss_nonfinite.is_not(None))
        .order_by(StepHealth.step)
        .limit(1)
    ).first()
    return [Health(first[0], float(first[1]))] if first else []


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def resume(s: Session, run_name: str, opts: ResumeOptions = ResumeOptions()) -> dict[str, Any]:
    """The resume answer (stable keys; see docs/API.md). Raises NoRestorableStepError if none."""
    run = get_run(s, run_name)
    now = datetime.now(timezone.utc)
    spike = SpikeRule(opts.spike_factor, opts.spike_window) if opts.skip_spikes else None
    policy = ResumePolicy(max_step=opts.max_step, spike=spike)
    health = _health(s, run.id, opts.skip_spikes)
    steps = step_infos(s, run.id, now, limit=_FIRST_BATCH)
    decision = policy.decide(steps, health)
    if decision.chosen is None and len(steps) == _FIRST_BATCH:
        decision = policy.decide(step_infos(s, run.id, now), health)
    skipped = [{"step": step, "reason": reason} for step, reason in decision.skipped]
    if decision.chosen is None:
        err = NoRestorableStepError(f"run {run_name!r} has no restorable step" + (
            f" at or before step {opts.max_step}" if opts.max_step is not None else ""))
        err.skipped = skipped  # type: ignore[attr-defined]
        raise err
    ckpt = s.get(Checkpoint, decision.chosen.id)
    assert ckpt is not None
    shards = s.execute(
        select(Shard.rank, Shard.path).where(Shard.checkpoint_id == ckpt.id, Shard.state == ShardState.VERIFIED.value).order_by(Shard.rank)
    ).all()
    strategy = s.get(StrategyFile, ckpt.strategy_id) if ckpt.strategy_id else None
    lease = _aware(ckpt.lease_until) if ckpt.lease_until is not None else None
    if opts.lease and (lease is None or lease < now + RESUME_LEASE / 2):
        ckpt.lease_until = now + RESUME_LEASE  # renewed at most every 15 min: polling stays read-only
    answer: dict[str, Any] = {
        "run": run.name,
        "step": decision.chosen.step,
        "epoch": ckpt.epoch,
        "global_step": ckpt.global_step,
        "name_step": ckpt.step,
        "prefix": ckpt.prefix,
        "world_size": ckpt.expected_ranks,
        "strategy_file": strategy.path if strategy else None,
        "strategy_hash": strategy.content_hash if strategy else None,
        "shards": [{"rank": r, "path": p} for r, p in shards],
        "skipped": skipped,
        "conversion": None,
    }
    if opts.world_size is not None and opts.world_size != ckpt.expected_ranks:
        answer["conversion"] = _conversion_info(s, ckpt, opts.world_size)
    return answer


def _conversion_info(s: Session, ckpt: Checkpoint, world_size: int) -> dict[str, Any]:
    """A different target world size needs the checkpoint re-sharded; point at a ready copy if any."""
    copies = s.execute(
        select(Checkpoint).where(
            Checkpoint.derived_from_id == ckpt.id, Checkpoint.kind == "converted", Checkpoint.expected_ranks == world_size,
            Checkpoint.state == "verified",
        )
    ).scalars().all()
    existing = None
    if copies:
        copy = copies[0]
        paths = s.execute(select(Shard.rank, Shard.path).where(Shard.checkpoint_id == copy.id).order_by(Shard.rank)).all()
        strat = s.get(StrategyFile, copy.strategy_id) if copy.strategy_id else None
        existing = {"shards": [{"rank": r, "path": p} for r, p in paths], "strategy_file": strat.path if strat else None,
                    "strategy_hash": copy.layout}
    return {
        "needed": True,
        "from_world_size": ckpt.expected_ranks,
        "to_world_size": world_size,
        "existing": existing,
        "hint": None if existing else ("POST /v1/runs/{run}/conversions {\"step\": S, \"to_layout\": \"tp=..,dp=..\"} "
                                        "or `ckptd convert --run R --step S --to-layout tp=..,dp=..`"),
    }


class ResumeCache:
    """Pre-serialized resume answers, reused while the run's catalog rows are unchanged.

    A restart storm is hundreds of launchers asking the same question. Each request reads a
    *generation* — a fingerprint of the run's checkpoint rows (states, marks, steps, strategies,
    converted copies) and the first non-finite loss — and reuses the cached bytes only if it is
    unchanged, so a cached answer is never served after anything that could change it. Entries
    also expire after ``ttl`` seconds, which keeps leases renewed.
    Answers that depend on the whole loss history (``skip_spikes``) are never cached.
    """

    def __init__(self, ttl: float = 300.0, max_entries: int = 4096) -> None:
        import threading

        self.ttl, self.max_entries = ttl, max_entries
        self._lock = threading.Lock()
        self._entries: dict[tuple, tuple[tuple, float, bytes]] = {}
        self.hits = self.misses = 0

    @staticmethod
    def generation(s: Session, run_name: str) -> tuple | None:
        """A fingerprint of everything the answer depends on, read in one pass.

        Content, not timestamps: ``updated_at`` values are taken in Python before commit, so a max
        over them can miss a change committed "earlier" by another thread. Leases are left out
        (they do not change the answer).
        """
        from ckptd.catalog.models import Run

        run_id = s.execute(select(Run.id).where(Run.name == run_name)).scalar()
        if run_id is None:
            return None
        rows = s.execute(
            select(Checkpoint.id, Checkpoint.state, Checkpoint.marked_bad, Checkpoint.step, Checkpoint.global_step,
                   Checkpoint.strategy_id, Checkpoint.expected_ranks, Checkpoint.kind, Checkpoint.derived_from_id,
                   Checkpoint.reason)
            .where(Checkpoint.run_id == run_id)
            .order_by(Checkpoint.id)
        ).all()
        nonfinite = s.execute(
            select(func.min(StepHealth.step)).where(StepHealth.run_id == run_id, StepHealth.loss_nonfinite.is_not(None))
        ).scalar()
        return (run_id, hash(tuple(tuple(r) for r in rows)), len(rows), nonfinite)

    def answer(self, s: Session, run_name: str, opts: ResumeOptions) -> bytes:
        import json
        import time

        if opts.skip_spikes:
            return json.dumps(resume(s, run_name, opts)).encode()
        gen = self.generation(s, run_name)
        key = (run_name, opts)
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and gen is not None and hit[0] == gen and now - hit[1] < self.ttl:
                self.hits += 1
                return hit[2]
        body = json.dumps(resume(s, run_name, opts)).encode()  # raises (uncached) when nothing is restorable
        with self._lock:
            self.misses += 1
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[key] = (gen, now, body)  # the generation read *before* computing: never newer than the body
        return body
