"""Request dependencies as ``Annotated`` aliases: the catalog session, the caller's scope, the daemon."""

from __future__ import annotations

import hmac
import re
from typing import Annotated, Iterator

from fastapi import Depends, HTTPException, Path, Request
from sqlalchemy.orm import Session

SCOPE_RANK = {"read": 0, "report": 1, "admin": 2}
RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$"
_RUN_RE = re.compile(RUN_NAME)


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions.begin() as session:
        yield session


def _scope(request: Request) -> str:
    tokens: dict[str, str] = request.app.state.tokens
    if not tokens:
        return "admin"  # no auth configured: only ever reachable on loopback (serve refuses otherwise)
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(401, {"code": "unauthorized", "message": "missing bearer token",
                                  "hint": "send 'Authorization: Bearer <token>'"}, headers={"WWW-Authenticate": "Bearer"})
    for known, scope in tokens.items():
        if hmac.compare_digest(known.encode(), token.encode()):
            return scope
    raise HTTPException(401, {"code": "unauthorized", "message": "unknown token", "hint": "check the token"},
                        headers={"WWW-Authenticate": "Bearer"})


def require(minimum: str):
    def check(request: Request) -> str:
        scope = _scope(request)
        if SCOPE_RANK[scope] < SCOPE_RANK[minimum]:
            raise HTTPException(403, {"code": "forbidden", "message": f"this needs the {minimum!r} scope, token has {scope!r}",
                                      "hint": "use a token with a higher scope"})
        return scope

    return check


def run_name(run: Annotated[str, Path(description="run directory name under the checkpoint root")]) -> str:
    # run names come from directory names; anything else (.., slashes, NUL) never names a run
    if not _RUN_RE.match(run) or ".." in run:
        raise HTTPException(400, {"code": "invalid_run_name", "message": f"{run!r} is not a valid run name",
                                  "hint": "letters, digits, '.', '_' and '-' only"})
    return run


SessionDep = Annotated[Session, Depends(get_session)]
ReadScope = Annotated[str, Depends(require("read"))]
ReportScope = Annotated[str, Depends(require("report"))]
AdminScope = Annotated[str, Depends(require("admin"))]
RunName = Annotated[str, Depends(run_name)]
