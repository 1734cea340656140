"""Errors → HTTP: every error answer is ``{"detail": {code, message, hint}}`` with a 4xx status,
or 503 ``catalog_unavailable`` when the catalog cannot take the request (read-only, deleted, locked,
unreachable: ``ckptd.catalog.db.catalog_problem`` says which, in words).

Domain errors (``CkptdError``) map by code; request validation is 422; HTTP errors the framework
raises itself (unknown path 404, wrong method 405) get the same body. ``responses(...)`` is what
the routes declare, so the OpenAPI document lists the statuses and the body the server really
sends (not FastAPI's default ``HTTPValidationError``).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, DisconnectionError

from ckptd.catalog.db import catalog_problem
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptd.api.schemas import ErrorOut
from ckptd.errors import CkptdError

log = logging.getLogger("ckptd.api")

CATALOG_HINT = "see /healthz and the daemon log; ckptd retries with a new connection on every request"
STATUS = {"not_found": 404, "no_restorable_step": 404, "invalid_request": 400, "conflict": 409}
_HTTP_CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 409: "conflict", 413: "payload_too_large", 415: "unsupported_media_type",
               503: "catalog_unavailable"}

_WHAT = {
    400: "invalid request (detail.code invalid_request, or invalid_run_name for a run name outside the pattern)",
    401: "missing or unknown bearer token (detail.code unauthorized)",
    403: "the token's scope is too low (detail.code forbidden)",
    404: "no such run, step or job (detail.code not_found)",
    409: "conflicts with the catalog's state (detail.code conflict)",
    413: "request body larger than this route accepts (detail.code payload_too_large)",
    422: "malformed body, path or query parameter (detail.code invalid_request; detail.message says which)",
    503: "the catalog cannot take the request now: read-only, deleted, locked or unreachable (detail.code "
         "catalog_unavailable; detail.message says which)",
}


def responses(*codes: int, described: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses a route can answer, each with the real body
    (``described``: a route's own wording for some of them)."""
    texts = {**_WHAT, **(described or {})}
    return {code: {"model": ErrorOut, "description": texts[code]} for code in sorted({*codes, *(described or {})})}


def text_route_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses`` for a route whose success is not JSON (FastAPI would file the error bodies under
    the route's own media type): the same JSON error body, declared explicitly."""
    ref = {"$ref": "#/components/schemas/ErrorOut"}  # registered by every other route's responses()
    return {code: {"description": _WHAT[code], "content": {"application/json": {"schema": ref}}} for code in codes}


def body(code: str, message: str, hint: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"detail": {"code": code, "message": message, "hint": hint, **extra}}


def install(app: FastAPI) -> None:
    @app.exception_handler(CkptdError)
    async def _domain(_: Request, exc: CkptdError) -> JSONResponse:
        extra = {k: getattr(exc, k) for k in ("skipped", "unjudged", "unjudged_unreachable") if hasattr(exc, k)}
        return JSONResponse(body(exc.code, exc.message, exc.hint, **extra), status_code=STATUS.get(exc.code, 400))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail
        if not isinstance(detail, dict):  # the framework's own: "Not Found", "Method Not Allowed"
            detail = body(_HTTP_CODES.get(exc.status_code, "error"), str(detail))["detail"]
        headers = exc.headers
        if exc.status_code == 405:  # every method of the path, not only the first matching route's
            headers = {**(headers or {}), "Allow": request.app.state.methods.allow_header(request.scope["path"])}
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()
        ]
        return JSONResponse(body("invalid_request", "; ".join(problems), "see /docs for the schema"), status_code=422)

    @app.exception_handler(DataError)
    async def _data(_: Request, exc: DataError) -> JSONResponse:
        # the schema bounds every value to what the catalog holds; should one still not fit (a
        # number out of range, a character the database refuses), it is the request's fault
        log.warning("catalog refused a value from a request: %s", exc.orig)
        return JSONResponse(body("invalid_request", "a value does not fit the catalog", "see /docs for the bounds"),
                            status_code=400)

    @app.exception_handler(DBAPIError)
    @app.exception_handler(DisconnectionError)
    async def _catalog(_: Request, exc: Exception) -> JSONResponse:
        # the catalog deleted, read-only, locked or unreachable: the service's state, not the
        # request's fault nor a bug. The words come from catalog_problem, never the SQL.
        problem = catalog_problem(exc)
        if problem is None:
            return await _bug(_, exc)
        log.error("catalog unavailable (%s): %s", problem, getattr(exc, "orig", exc))
        return JSONResponse(body("catalog_unavailable", problem, CATALOG_HINT), status_code=503,
                            headers={"Retry-After": "10"})

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - defensive
        log.exception("unhandled error")
        return JSONResponse(body("internal", exc.__class__.__name__, "see the daemon log"), status_code=500)
