"""``/`` and ``/runs/{run}``: the status page (server-rendered HTML, ``ckptd.api.page``).

Same access rule as the read API (the ``read`` scope: with tokens configured the page needs
``Authorization: Bearer``, like ``GET /v1/runs``), and the same service functions as the API's
read routes: ``catalog.list_runs`` / ``run_dict`` / ``list_steps`` / ``list_nodes`` /
``health_rows``, ``resume.resume`` (the answer the launcher gets, never leased here),
``conversions.list_conversions`` and ``jobs.list_jobs``. Not in the OpenAPI document: it is a
page for people, not part of the API contract.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session

from ckptd.api import page
from ckptd.api.deps import ReadScope, RunName, SessionDep, valid_run_name
from ckptd.service import catalog, conversions
from ckptd.service import jobs as jobs_svc
from ckptd.service.resume import NoRestorableStepError, ResumeOptions, resume
from ckptd.settings import Settings

router = APIRouter(include_in_schema=False)

#: the page loads nothing and runs nothing: a string from the catalog that escaped escaping still could not
_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                                       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"}
#: the newest steps a page shows (the API's default page of GET /v1/runs/{run}/steps)
STEPS_SHOWN = 1000


def _refresh() -> Any:
    return Query(default=10, ge=0, le=3600, description="seconds between the page's reloads (0: never)")


@router.get("/", response_class=HTMLResponse)
def overview(request: Request, s: SessionDep, _: ReadScope, refresh: int = _refresh()) -> HTMLResponse:
    settings: Settings = request.app.state.settings
    runs = []
    for run in catalog.list_runs(s):
        facts = _run_facts(s, run["name"], settings, curves=False)
        runs.append({"run": run, "views": facts["views"], "rpo": facts["rpo"], "linkable": valid_run_name(run["name"])})
    doc = page.overview_page(runs, catalog.list_nodes(s, settings.node_timeout), jobs_svc.list_jobs(s),
                             datetime.now(timezone.utc), refresh)
    return HTMLResponse(doc, headers=_HEADERS)


@router.get("/runs/{run}", response_class=HTMLResponse)
def run_page(run: RunName, request: Request, s: SessionDep, _: ReadScope, refresh: int = _refresh()) -> HTMLResponse:
    settings: Settings = request.app.state.settings
    try:
        doc = catalog.run_dict(s, catalog.get_run(s, run))
    except catalog.NotFoundError as err:
        return HTMLResponse(page.missing_page(str(err)), status_code=404, headers=_HEADERS)
    facts = _run_facts(s, run, settings)
    html = page.run_page(doc, facts["views"], facts["rpo"], facts["health"], conversions.list_conversions(s, run),
                         jobs_svc.list_jobs(s), catalog.list_nodes(s, settings.node_timeout),
                         datetime.now(timezone.utc), refresh)
    return HTMLResponse(html, headers=_HEADERS)


def _run_facts(s: Session, name: str, settings: Settings, curves: bool = True) -> dict[str, Any]:
    """A run's steps as the page shows them, its recovery point and (``curves``: the run's own
    page) its health reports; the overview reads only the newest reported step."""
    opts = ResumeOptions(lease=False, node_timeout=settings.node_timeout, hardlinks=settings.allow_hardlinks,
                         memory_root=str(settings.memory_root) if settings.memory_root is not None else None)
    try:
        answer: dict[str, Any] | None = resume(s, name, opts)
        skipped = answer["skipped"]
    except NoRestorableStepError as err:
        answer, skipped = None, getattr(err, "skipped", [])
    views = page.step_views(catalog.list_steps(s, name, None, STEPS_SHOWN), skipped)
    run_id = catalog.get_run(s, name).id
    health = [{"step": step, "loss": loss, "grad_norm": gn, "overflow": ov}
              for step, loss, gn, ov in catalog.health_rows(s, run_id)] if curves else []
    newest = max((h["step"] for h in health), default=None) if curves else catalog.newest_reported_step(s, run_id)
    return {"views": views, "health": health, "rpo": page.rpo(answer, views, newest, datetime.now(timezone.utc))}
