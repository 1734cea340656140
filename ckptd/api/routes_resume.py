"""/v1/runs/{run}/resume and /health: the launcher's and the trainer's endpoints."""

from __future__ import annotations


from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ckptd.api.deps import ReadScope, ReportScope, RunName, SessionDep
from ckptd.api.schemas import HealthReport, ResumeAnswer
from ckptd.service import catalog
from ckptd.service.resume import ResumeOptions

router = APIRouter(prefix="/v1/runs", tags=["resume"])


@router.get(
    "/{run}/resume",
    response_model=ResumeAnswer,
    responses={404: {"description": "no restorable step (detail.code = no_restorable_step, detail.skipped lists why)"}},
)
def get_resume(
    run: RunName, s: SessionDep, _: ReadScope, request: Request,
    max_step: int | None = Query(default=None, ge=0, description="resume at or before this step"),
    world_size: int | None = Query(default=None, ge=1, description="target world size; a mismatch sets 'conversion'"),
    skip_spikes: bool = Query(default=False, description="also skip steps from the first loss spike on"),
    spike_factor: float = Query(default=3.0, gt=1.0),
    spike_window: int = Query(default=20, ge=2),
    lease: bool = Query(default=True, description="protect the answer from retention for 30 minutes"),
) -> Response:
    """The latest restorable step: every shard verified, not marked bad, training healthy."""
    opts = ResumeOptions(max_step, world_size, skip_spikes, spike_factor, spike_window, lease)
    # The hot path of a restart storm: answers are cached pre-serialized (see ResumeCache) and not
    # re-validated — the service builds exactly ResumeAnswer's keys (tests pin them).
    return Response(request.app.state.resume_cache.answer(s, run, opts), media_type="application/json")


@router.post("/{run}/health", status_code=204)
def post_health(run: RunName, body: HealthReport, s: SessionDep, _: ReportScope) -> None:
    catalog.report_health(s, run, body.step, body.loss, body.grad_norm, body.overflow)
