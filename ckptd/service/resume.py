"""The resume oracle: what a launcher is told after a failure.

Loads the run's steps and training health from the catalog, lets :class:`ckptd.policy.ResumePolicy`
choose, and answers with everything a relaunch needs. The chosen step is leased for a while so
retention cannot delete it between the answer and the restarted job loading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptd.catalog.models import Checkpoint, Shard, StrategyFile
from ckptd.errors import CkptdError
from ckptd.policy import Health, ResumePolicy, SpikeRule, StepInfo
from ckptd.service.catalog import get_run, health_history
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


def step_infos(s: Session, run_id: int, now: datetime) -> list[StepInfo]:
    rows = s.execute(select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.kind == "trained")).scalars()
    return [
        StepInfo(
            id=c.id,
            step=c.global_step if c.global_step is not None else c.step,
            state=c.state,
            reason=c.reason,
            marked_bad=c.marked_bad,
            bad_reason=c.bad_reason,
            pinned=c.pinned,
            in_use=c.lease_until is not None and _aware(c.lease_until) > now,
        )
        for c in rows
    ]


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def resume(s: Session, run_name: str, opts: ResumeOptions = ResumeOptions()) -> dict[str, Any]:
    """The resume answer (stable keys; see docs/API.md). Raises NoRestorableStepError if none."""
    run = get_run(s, run_name)
    now = datetime.now(timezone.utc)
    spike = SpikeRule(opts.spike_factor, opts.spike_window) if opts.skip_spikes else None
    health = [Health(step, loss, gn, bool(ov)) for step, loss, gn, ov in health_history(s, run)]
    decision = ResumePolicy(max_step=opts.max_step, spike=spike).decide(step_infos(s, run.id, now), health)
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
    if opts.lease:
        ckpt.lease_until = now + RESUME_LEASE
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
        existing = {"shards": [{"rank": r, "path": p} for r, p in paths], "strategy_file": strat.path if strat else None}
    return {
        "needed": True,
        "from_world_size": ckpt.expected_ranks,
        "to_world_size": world_size,
        "existing": existing,
        "hint": None if existing else "run `ckptd convert --run R --step S --to-strategy NEW --out DIR` first",
    }
