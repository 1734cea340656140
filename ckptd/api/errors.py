"""CkptdError → HTTP: every domain error becomes a 4xx JSON body ``{"detail": {code, message, hint}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ckptd.errors import CkptdError

log = logging.getLogger("ckptd.api")

STATUS = {"not_found": 404, "no_restorable_step": 404, "invalid_request": 400, "conflict": 409}


def install(app: FastAPI) -> None:
    @app.exception_handler(CkptdError)
    async def _domain(_: Request, exc: CkptdError) -> JSONResponse:
        body = {"code": exc.code, "message": exc.message, "hint": exc.hint}
        if hasattr(exc, "skipped"):
            body["skipped"] = exc.skipped  # type: ignore[attr-defined]
        return JSONResponse({"detail": body}, status_code=STATUS.get(exc.code, 400))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()
        ]
        return JSONResponse(
            {"detail": {"code": "invalid_request", "message": "; ".join(problems), "hint": "see /docs for the schema"}},
            status_code=422,
        )

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - defensive
        log.exception("unhandled error")
        return JSONResponse({"detail": {"code": "internal", "message": exc.__class__.__name__, "hint": "see the daemon log"}},
                            status_code=500)
