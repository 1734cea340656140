"""/healthz, /metrics (Prometheus text), /v1/jobs, /v1/gc."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from ckptd.api.deps import AdminScope, JobId, ReadScope, RunName, SessionDep
from ckptd.api.errors import responses, text_route_responses
from ckptd.api.guard import DEFAULT_MAX_BODY, max_body
from ckptd.api.schemas import GcOut, GcRequest, HealthzOut, JobOut
from ckptd.catalog.db import probe
from ckptd.policy import RetentionPolicy
from ckptd.service import jobs as jobs_svc
from ckptd.service.metrics import CONTENT_TYPE
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
            "stalled": stalled,
            # the object tier's trouble is reported, not fatal: the file tier keeps serving (status stays ok)
            "object_tier": daemon.objects.status() if daemon.objects is not None else None}


@router.get("/metrics", response_class=PlainTextResponse, responses=text_route_responses(401, 403, 422))
def metrics(request: Request, _: ReadScope) -> Response:
    """Prometheus text exposition: this daemon's counters and latencies, and the catalog's state
    read now (``ckptd.service.metrics``)."""
    return Response(request.app.state.daemon.metrics.render(), media_type=CONTENT_TYPE)


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
