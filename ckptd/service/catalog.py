"""Read models and operator actions over the catalog: runs, steps, shards, health, marks, pins.

The API and the CLI both call these functions and only translate the results; nothing here knows
about HTTP or argv. Results are plain dicts with stable keys (they become JSON).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.orm import Session

from ckptd.catalog import copies, reads
from ckptd.catalog.models import Checkpoint, Run, Shard, StepHealth, as_utc
from ckptd.catalog.repo import insert_ignore
from ckptd.errors import CkptdError
from ckptd import runlayout, stepname
from ckptd.states import ShardState, StepState, Tier


class NotFoundError(CkptdError):
    code = "not_found"
    default_hint = "list what exists with `ckptd ls` or GET /v1/runs"


class InvalidRequestError(CkptdError):
    code = "invalid_request"


def iso_time(dt: datetime | None) -> str | None:
    return None if dt is None else as_utc(dt).isoformat()


def get_run(s: Session, name: str) -> Run:
    run = reads.run_named(s, name)
    if run is None:
        raise NotFoundError(f"no run named {name!r} in the catalog")
    return run


def get_step(s: Session, run: Run, step: int, kind: str = "trained") -> Checkpoint:
    """A step by its training step: the global step its files record, or — not verified yet —
    the step in its file names (MindFormers names count within the epoch). Of two saves of one
    step (two incarnations after a restart) the newer is meant."""
    rows = reads.steps_at(s, run.id, step, kind)
    if not rows:
        raise NotFoundError(f"run {run.name!r} has no {kind} checkpoint at step {step}")
    return rows[0]


def latest_restorable(s: Session, run_id: int) -> tuple[int, datetime] | None:
    """The run's newest restorable step as users count training (its global step), and when it was
    saved (first seen); None while it has none (``GET /v1/runs``, ``/metrics``' recovery point)."""
    latest = reads.latest_verified_step(s, run_id)
    return (_named(latest), latest[3]) if latest else None


def run_dict(s: Session, run: Run) -> dict[str, Any]:
    counts = reads.step_state_counts(s, run.id)
    latest = latest_restorable(s, run.id)
    nodes = reads.live_shards_per_node(s, run.id)
    return {
        "name": run.name,
        "path": run.path,
        "layout": runlayout.by_name(run.layout).name,
        "nodes": {str(n): c for n, c in sorted(nodes.items(), key=lambda kv: str(kv[0]))},
        "world_size": run.world_size,
        "steps": counts,
        # as users count training (the global step), not the file names' within-epoch number
        "latest_restorable_step": latest[0] if latest else None,
        "latest_restorable_at": iso_time(latest[1]) if latest else None,
        "created_at": iso_time(run.created_at),
    }


def _named(latest: tuple) -> int:
    """A step as the resume oracle names it: its global step, else the file name's step."""
    return stepname.filed_step(latest[0], latest[2])


def list_nodes(s: Session, timeout: float) -> list[dict[str, Any]]:
    """Every daemon node with its liveness and the shards it owns per state."""
    from ckptd.catalog import nodes

    counts = nodes.shard_counts(s)
    return [{"name": st.name, "reachable": st.reachable, "heartbeat_at": iso_time(st.heartbeat_at),
             "seconds_since_heartbeat": round(st.seconds_since_heartbeat, 3), "shards": counts.get(st.name, {})}
            for st in sorted(nodes.statuses(s, timeout).values(), key=lambda x: x.name)]


def list_runs(s: Session) -> list[dict[str, Any]]:
    return [run_dict(s, r) for r in reads.runs(s)]


def step_dict(c: Checkpoint, *, strategy_path: str | None = None, shards: list[Shard] | None = None,
              shards_step: int | None = None, tiers: list[Tier] | None = None,
              held: dict[int, list[copies.Copy]] | None = None) -> dict[str, Any]:
    """A step as the API and the CLI show it. ``tiers``: the tiers it is whole on
    (``copies.whole_tiers``; omitted from the dict when not asked); ``held``: each rank's copies
    (``copies.of_step``), listed under its live shard; a rank with copies but no file is listed too."""
    users = stepname.users_step(c.global_step, shards_step, c.epoch, c.step)
    out: dict[str, Any] = {
        "step": c.step,
        "epoch": c.epoch,
        # the step as users count training (the global step); "step" is the file names' number
        "training_step": users,
        "file_name_note": stepname.file_name_note(c.epoch, c.step, users),
        "incarnation": c.incarnation,
        "prefix": c.prefix,
        "kind": c.kind,
        "global_step": c.global_step,
        "state": c.state,
        "restorable": c.state == StepState.VERIFIED.value and not c.marked_bad,
        "expected_ranks": c.expected_ranks,
        "reason": c.reason,
        "health_reason": c.health_reason,
        "marked_bad": c.marked_bad,
        "bad_reason": c.bad_reason,
        "pinned": c.pinned,
        "strategy_file": strategy_path,
        "updated_at": iso_time(c.updated_at),
    }
    if tiers is not None:
        out["tiers"] = [t.value for t in tiers]
    if shards is not None:
        out["shards"] = [shard_dict(sh, None if held is None or sh.state == ShardState.SUPERSEDED.value
                                    else held.get(sh.rank)) for sh in sorted(shards, key=lambda x: (x.rank, x.path))]
        if held is not None:
            out["copies_without_file"] = [copy_dict(cp) for rank, cps in sorted(held.items())
                                      if rank not in {sh.rank for sh in shards} for cp in cps]
    return out


def copy_dict(cp: copies.Copy) -> dict[str, Any]:
    return {"rank": cp.rank, "tier": cp.tier.value, "location": cp.location, "state": cp.state, "size": cp.size, "digest": cp.digest,
            "node": cp.node, "error": cp.error, "verified_at": iso_time(cp.verified_at)}


def shard_dict(sh: Shard, held: list[copies.Copy] | None = None) -> dict[str, Any]:
    out = {
        "rank": sh.rank,
        "path": sh.path,
        "state": sh.state,
        "size": sh.size,
        "digest": sh.digest,
        "format": sh.format,
        "encryption": sh.encryption,
        "crc": sh.crc,
        "global_step": sh.global_step,
        "error_code": sh.error_code,
        "error": sh.error,
        "quarantined": sh.quarantined,
        "verified_at": iso_time(sh.verified_at),
        "node": sh.node,
    }
    if held is not None:
        out["copies"] = [copy_dict(cp) for cp in held]
    return out


def list_steps(s: Session, run_name: str, state: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
    run = get_run(s, run_name)
    if state is not None and state not in {v.value for v in StepState}:
        raise InvalidRequestError(
            f"unknown state {state!r}", hint="one of " + ", ".join(v.value for v in StepState)
        )
    rows = reads.steps_with_shards_step(s, run.id, state, limit)
    paths = reads.strategy_paths(s, {c.strategy_id for c, _ in rows if c.strategy_id})
    tiers = copies.whole_tiers(s, [c for c, _ in rows])
    return [step_dict(c, strategy_path=paths.get(c.strategy_id), shards_step=seen, tiers=tiers[c.id]) for c, seen in rows]


def show_step(s: Session, run_name: str, step: int, node_timeout: float) -> dict[str, Any]:
    """A step with its shards; each shard says whether its node is ``reachable`` now (heartbeat
    within ``node_timeout``; None: a row no registered node holds, e.g. from before migration 0006)."""
    from ckptd.catalog import nodes

    run = get_run(s, run_name)
    c = get_step(s, run, step)
    shards = reads.shards_of(s, c.id)
    seen = max((sh.global_step for sh in shards if sh.global_step is not None and sh.state == ShardState.VERIFIED.value),
               default=None)
    doc = step_dict(c, strategy_path=reads.strategy_paths(s, {c.strategy_id}).get(c.strategy_id), shards=list(shards),
                    shards_step=seen, tiers=copies.whole_tiers(s, [c])[c.id], held=copies.of_step(s, c.id, list(shards)))
    known = nodes.statuses(s, node_timeout)
    for sh in doc["shards"]:
        sh["reachable"] = known[sh["node"]].reachable if sh["node"] in known else None
    return doc


# --- operator actions and health ---------------------------------------------------------------


def mark_bad(s: Session, run_name: str, step: int, reason: str | None, bad: bool = True) -> dict[str, Any]:
    c = get_step(s, get_run(s, run_name), step)
    c.marked_bad, c.bad_reason = bad, (reason if bad else None)
    return step_dict(c)


def pin(s: Session, run_name: str, step: int, pinned: bool = True) -> dict[str, Any]:
    c = get_step(s, get_run(s, run_name), step)
    c.pinned = pinned
    return step_dict(c)


def report_health(s: Session, run_name: str, step: int, loss: float | None, grad_norm: float | None, overflow: bool) -> None:
    """Upsert one step's training health. NaN/inf are meaningful (divergence) and stored as such."""
    if step < 0:
        raise InvalidRequestError("step must be >= 0")
    run = reads.run_named(s, run_name)
    if run is None:
        from ckptd.catalog.repo import get_or_create_run

        run = get_or_create_run(s, run_name, "")  # the trainer may report before its first save
    values = {
        "loss": _finite(loss), "loss_nonfinite": _nonfinite(loss),
        "grad_norm": _finite(grad_norm), "grad_norm_nonfinite": _nonfinite(grad_norm),
        "overflow": overflow, "reported_at": datetime.now(timezone.utc),
    }
    inserted = insert_ignore(s, StepHealth, {"run_id": run.id, "step": step, **values}, ["run_id", "step"])
    if not inserted:
        row = reads.health_row(s, run.id, step)
        for k, v in values.items():
            setattr(row, k, v)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _nonfinite(x: float | None) -> str | None:
    return None if x is None or math.isfinite(x) else str(x)


def newest_reported_step(s: Session, run_id: int) -> int | None:
    return reads.newest_health_step(s, run_id)


def health_rows(s: Session, run_id: int) -> list[tuple[int, float | None, float | None, bool]]:
    """Every reported step's (step, loss, grad_norm, overflow), NaN/inf restored."""
    rows = reads.health_values(s, run_id)
    return [(step, float(lnf) if lnf else loss, float(gnf) if gnf else gn, ov) for step, loss, lnf, gn, gnf, ov in rows]
