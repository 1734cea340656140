"""/healthz, /metrics (Prometheus text), /v1/jobs, /v1/gc."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from ckptd.api.routes_nodes import node_metric_lines
from ckptd.api.deps import AdminScope, JobId, ReadScope, RunName, SessionDep
from ckptd.api.errors import responses, text_route_responses
from ckptd.api.guard import DEFAULT_MAX_BODY, max_body
from ckptd.api.promtext import sample
from ckptd.api.schemas import GcOut, GcRequest, HealthzOut, JobOut
from ckptd.catalog import reads
from ckptd.catalog.db import probe
from ckptd.policy import RetentionPolicy
from ckptd.service import jobs as jobs_svc
from ckptd.service.retention import gc

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=HealthzOut,
            responses={**responses(422), 503: {"model": HealthzOut, "description": "the catalog cannot take writes "
                                                                                  "(status catalog_unavailable, catalog "
                                                                                  "says why), or a worker made no "
                                                                                  "progress for worker_stall_seconds "
                                                                                  "(status stalled)"}})
def healthz(request: Request, response: Response) -> dict[str, Any]:
    daemon = request.app.state.daemon
    watcher = daemon.watcher
    catalog = probe(daemon.engine)  # a real read and a write started (rolled back), not SELECT 1
    stalled = {name: round(seconds, 3) for name, seconds in daemon.stalls().items()}
    if catalog is not None or stalled:
        response.status_code = 503  # a load balancer / supervisor acts on the status, not the body
    status = "catalog_unavailable" if catalog is not None else "stalled" if stalled else "ok"
    return {"status": status, "catalog": catalog or "ok", "first_rescan_done": watcher.ready.is_set(),
            "rescans": watcher.rescans, "file_events": watcher.backend, "file_events_lost": watcher.events_lost,
            "stalled": stalled}


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds:.1f}" if seconds > 0 else "0"


@router.get("/metrics", response_class=PlainTextResponse, responses=text_route_responses(401, 403, 422))
def metrics(request: Request, s: SessionDep, _: ReadScope) -> str:
    daemon = request.app.state.daemon
    verifier = daemon.verifier
    node = request.app.state.settings.node_name
    lines = [
        "# HELP ckptd_shards Shards in the catalog by state.",
        "# TYPE ckptd_shards gauge",
    ]
    for state, n in reads.shard_state_counts(s).items():
        lines.append(sample("ckptd_shards", n, state=state))
    lines += [
        "# HELP ckptd_shards_verified_total Shards verified since start.",
        "# TYPE ckptd_shards_verified_total counter",
        f"ckptd_shards_verified_total {verifier.verified_count}",
        "# HELP ckptd_verification_failures_total Shards found corrupt since start.",
        "# TYPE ckptd_verification_failures_total counter",
        f"ckptd_verification_failures_total {verifier.failed_count}",
        "# HELP ckptd_verified_bytes_total Bytes verified since start.",
        "# TYPE ckptd_verified_bytes_total counter",
        f"ckptd_verified_bytes_total {verifier.verified_bytes}",
        "# HELP ckptd_rescans_total Full rescans of the checkpoint root since start.",
        "# TYPE ckptd_rescans_total counter",
        f"ckptd_rescans_total {request.app.state.daemon.watcher.rescans}",
        "# HELP ckptd_file_events_lost_total Times file events may have been lost (queue overflow, watch limit); each triggers a rescan.",
        "# TYPE ckptd_file_events_lost_total counter",
        f"ckptd_file_events_lost_total {request.app.state.daemon.watcher.events_lost}",
        "# HELP ckptd_verification_seconds_total Time spent verifying shards.",
        "# TYPE ckptd_verification_seconds_total counter",
        f"ckptd_verification_seconds_total {verifier.verify_seconds:.6f}",
        "# HELP ckptd_verification_bytes_per_second Verification throughput of this node since start: bytes verified "
        "per second spent verifying (per worker; 0 before the first shard).",
        "# TYPE ckptd_verification_bytes_per_second gauge",
        sample("ckptd_verification_bytes_per_second", _rate(verifier.verified_bytes, verifier.verify_seconds), node=node),
        "# HELP ckptd_conversion_bytes_total Bytes written (and verified) by conversions on this node since start.",
        "# TYPE ckptd_conversion_bytes_total counter",
        f"ckptd_conversion_bytes_total {daemon.conversion_bytes}",
        "# HELP ckptd_conversion_seconds_total Wall time of conversions on this node since start.",
        "# TYPE ckptd_conversion_seconds_total counter",
        f"ckptd_conversion_seconds_total {daemon.conversion_seconds:.6f}",
        "# HELP ckptd_conversion_bytes_per_second Conversion throughput of this node since start (0 before the first).",
        "# TYPE ckptd_conversion_bytes_per_second gauge",
        sample("ckptd_conversion_bytes_per_second", _rate(daemon.conversion_bytes, daemon.conversion_seconds), node=node),
        "# HELP ckptd_recovery_point_seconds Seconds since each run's newest restorable step became restorable (RPO).",
        "# TYPE ckptd_recovery_point_seconds gauge",
    ]
    now = datetime.now(timezone.utc)
    for name, at in reads.latest_verified_at(s):
        at = at if at.tzinfo else at.replace(tzinfo=timezone.utc)
        lines.append(sample("ckptd_recovery_point_seconds", f"{(now - at).total_seconds():.3f}", run=name))
    lines += node_metric_lines(s, request.app.state.settings.node_timeout)
    lines.append(f"ckptd_up_seconds {time.monotonic() - request.app.state.started:.3f}")
    return "\n".join(lines) + "\n"


@router.get("/v1/jobs", response_model=list[JobOut], responses=responses(401, 403, 422))
def list_jobs(s: SessionDep, _: ReadScope) -> list[dict[str, Any]]:
    return jobs_svc.list_jobs(s)


@router.get("/v1/jobs/{job_id}", response_model=JobOut, responses=responses(401, 403, 404, 422))
def get_job(job_id: JobId, s: SessionDep, _: ReadScope) -> dict[str, Any]:
    return jobs_svc.get_job(s, job_id)


@router.post("/v1/jobs/{job_id}/cancel", response_model=JobOut,
             responses={**responses(401, 403, 404, 409, 413, 422),
                        202: {"model": JobOut, "description": "the job is running: it stops at its next progress "
                                                              "report (cancel_requested true; poll GET /v1/jobs/{id})"}},
             openapi_extra=max_body(DEFAULT_MAX_BODY))
def cancel_job(job_id: JobId, request: Request, response: Response, _: AdminScope) -> dict[str, Any]:
    """Cancel a job of this daemon: a queued one at once (200, ``failed``); a running one at its
    next progress report (202; a conversion's temp data is removed). 409: it has ended, or another
    process runs it."""
    doc = request.app.state.daemon.jobs.cancel(job_id)
    if doc["cancel_requested"]:
        response.status_code = 202
    return doc


@router.post("/v1/runs/{run}/gc", response_model=GcOut, tags=["runs"],
             responses=responses(400, 401, 403, 404, 413, 422), openapi_extra=max_body(DEFAULT_MAX_BODY))
def run_gc(run: RunName, body: GcRequest, request: Request, _: AdminScope) -> dict[str, Any]:
    policy = RetentionPolicy(keep_last=body.keep_last, keep_every=body.keep_every)
    return gc(request.app.state.sessions, request.app.state.settings.storage, policy,
              run_name=run, dry_run=body.dry_run, owner=request.app.state.daemon.nodes.owner(),
              torn_grace=request.app.state.settings.gc_torn_grace).to_dict()
