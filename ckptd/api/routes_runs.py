"""/v1/runs: runs, steps, shards, operator marks, re-verification."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request

from ckptd.api.deps import AdminScope, ReadScope, RunName, SessionDep, Step
from ckptd.api.errors import responses
from ckptd.api.guard import DEFAULT_MAX_BODY, max_body
from ckptd.api.schemas import JobOut, MarkRequest, RunOut, SettledOut, ShardOut, StepDetailOut, StepOut, VerifyRequest
from ckptd.service import catalog
from ckptd.service.settled import Barrier
from ckptd.states import StepState

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=responses(401, 403, 422))
_RUN = responses(400, 404)  # an invalid run name; no such run (or step)
_BODY = {"responses": responses(400, 404, 413), "openapi_extra": max_body(DEFAULT_MAX_BODY)}
_STATES = [s.value for s in StepState]


@router.get("", response_model=list[RunOut])
def list_runs(s: SessionDep, _: ReadScope) -> list[dict[str, Any]]:
    return catalog.list_runs(s)


@router.get("/{run}", response_model=RunOut, responses=_RUN)
def get_run(run: RunName, s: SessionDep, _: ReadScope) -> dict[str, Any]:
    return catalog.run_dict(s, catalog.get_run(s, run))


@router.get("/{run}/settled", response_model=SettledOut, responses=_RUN)
async def settled(
    run: RunName, request: Request, _: ReadScope,
    wait: float = Query(default=10.0, ge=0, le=600, description="answer as soon as settled, at most this many "
                                                                "seconds later (then settled: false)"),
) -> dict[str, Any]:
    """Has ckptd judged everything committed under the run up to now? (the launcher asks before resuming)"""
    d = request.app.state.daemon
    settings = request.app.state.settings
    barrier = Barrier(d.sessions, d.watcher, str(settings.root), settings.node_name, settings.node_timeout, d.memory)
    return await barrier.wait(run, wait)


@router.get("/{run}/steps", response_model=list[StepOut], responses=_RUN)
def list_steps(
    run: RunName, s: SessionDep, _: ReadScope,
    state: str | None = Query(default=None, description="only steps in this state (another value: 400)",
                              json_schema_extra={"enum": _STATES}),
    limit: int = Query(default=1000, ge=1, le=100000),
) -> list[dict[str, Any]]:
    return catalog.list_steps(s, run, state, limit)


@router.get("/{run}/steps/{step}", response_model=StepDetailOut, responses=_RUN)
def get_step(run: RunName, step: Step, s: SessionDep, request: Request, _: ReadScope) -> dict[str, Any]:
    return catalog.show_step(s, run, step, request.app.state.settings.node_timeout)


@router.get("/{run}/steps/{step}/shards", response_model=list[ShardOut], responses=_RUN)
def get_shards(run: RunName, step: Step, s: SessionDep, request: Request, _: ReadScope) -> list[dict[str, Any]]:
    return catalog.show_step(s, run, step, request.app.state.settings.node_timeout)["shards"]


@router.post("/{run}/steps/{step}/mark-bad", response_model=StepOut, **_BODY)
def mark_bad(run: RunName, step: Step, body: MarkRequest, s: SessionDep, _: AdminScope) -> dict[str, Any]:
    return catalog.mark_bad(s, run, step, body.reason)


@router.post("/{run}/steps/{step}/unmark-bad", response_model=StepOut, **_BODY)
def unmark_bad(run: RunName, step: Step, s: SessionDep, _: AdminScope) -> dict[str, Any]:
    return catalog.mark_bad(s, run, step, None, bad=False)


@router.post("/{run}/steps/{step}/pin", response_model=StepOut, **_BODY)
def pin(run: RunName, step: Step, s: SessionDep, _: AdminScope) -> dict[str, Any]:
    return catalog.pin(s, run, step, True)


@router.post("/{run}/steps/{step}/unpin", response_model=StepOut, **_BODY)
def unpin(run: RunName, step: Step, s: SessionDep, _: AdminScope) -> dict[str, Any]:
    return catalog.pin(s, run, step, False)


@router.post("/{run}/verify", response_model=JobOut, status_code=202, **_BODY)
def reverify(run: RunName, body: VerifyRequest, request: Request, _: AdminScope) -> dict[str, Any]:
    """Re-verify a run (or one step) in the background; poll GET /v1/jobs/{id} for progress."""
    return request.app.state.daemon.jobs.start_verify(run, body.step)
