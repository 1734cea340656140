"""/v1/runs/{run}/conversions: re-shard a verified step for another layout (background job)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ckptd.api.deps import AdminScope, ReadScope, RunName, SessionDep
from ckptd.api.errors import responses
from ckptd.api.guard import DEFAULT_MAX_BODY, max_body
from ckptd.api.schemas import ConversionOut, ConversionRequest, JobOut
from ckptd.service import conversions
from ckptd.split import parse_split

router = APIRouter(prefix="/v1/runs", tags=["conversions"], responses=responses(400, 401, 403, 404, 422))


@router.get("/{run}/conversions", response_model=list[ConversionOut])
def list_conversions(run: RunName, s: SessionDep, _: ReadScope) -> list[dict[str, Any]]:
    return conversions.list_conversions(s, run)


@router.post("/{run}/conversions", response_model=JobOut, status_code=202, responses=responses(409, 413),
             openapi_extra=max_body(DEFAULT_MAX_BODY))
def start_conversion(run: RunName, body: ConversionRequest, request: Request, _: AdminScope) -> dict[str, Any]:
    """Convert in the background into ``<root>/<run>/converted/``; poll ``GET /v1/jobs/{id}``.

    The result is catalogued as a converted copy, which ``/resume?world_size=W`` then points at.
    """
    daemon = request.app.state.daemon
    store = daemon.store
    split = parse_split(body.to_layout, "to_layout") if body.to_layout is not None else None
    with daemon.sessions() as s:  # 400 / 404 now, not a failed job later (a too-large to_layout too)
        conversions.check_request(s, store, run, body.step, split=split, to_strategy=body.to_strategy)

    def work(progress):  # noqa: ANN001, ANN202
        doc = conversions.convert_step(
            daemon.sessions, store, run, body.step, to_strategy=body.to_strategy, split=split,
            key=daemon.verifier.rules.key, progress=progress, node=daemon.settings.node_name,
        )
        report = doc.get("report")
        if report is not None:  # a reused copy moved no bytes
            daemon.record_conversion(report["bytes_written"], report["seconds"])
        return doc

    return daemon.jobs.start("convert", run, body.model_dump(), 0, work)
