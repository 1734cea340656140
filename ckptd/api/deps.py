"""Request dependencies as ``Annotated`` aliases: the catalog session, the caller's scope, the daemon."""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request
from sqlalchemy.orm import Session

SCOPE_RANK = {"read": 0, "report": 1, "admin": 2}
RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$"
_RUN_RE = re.compile(RUN_NAME)


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions.begin() as session:
        yield session


def token_scope(tokens: dict[str, str], authorization: str) -> str | None:
    """The scope an ``Authorization`` header grants, None if it grants nothing (no/unknown token)."""
    if not tokens:
        return "admin"  # no auth configured: only ever reachable on loopback (serve refuses otherwise)
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    for known, scope in tokens.items():
        if hmac.compare_digest(known.encode(), token.encode()):
            return scope
    return None


def valid_run_name(run: str) -> bool:
    # run names come from directory names; anything else (.., slashes, NUL) never names a run
    return bool(_RUN_RE.match(run)) and ".." not in run


def _scope(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scope = token_scope(request.app.state.tokens, header)
    if scope is not None:
        return scope
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(401, {"code": "unauthorized", "message": "missing bearer token",
                                  "hint": "send 'Authorization: Bearer <token>'"}, headers={"WWW-Authenticate": "Bearer"})
    raise HTTPException(401, {"code": "unauthorized", "message": "unknown token", "hint": "check the token"},
                        headers={"WWW-Authenticate": "Bearer"})


def require(minimum: str):
    # async on purpose (here and in _run_name_param): pure CPU, so FastAPI runs them inline instead of
    # sending each to the thread pool
    async def check(request: Request) -> str:
        scope = _scope(request)
        if SCOPE_RANK[scope] < SCOPE_RANK[minimum]:
            raise HTTPException(403, {"code": "forbidden", "message": f"this needs the {minimum!r} scope, token has {scope!r}",
                                      "hint": "use a token with a higher scope"})
        return scope

    return check


def run_name(run: str) -> str:
    if not valid_run_name(run):
        raise HTTPException(400, {"code": "invalid_run_name", "message": f"{run!r} is not a valid run name",
                                  "hint": "letters, digits, '.', '_' and '-' only"})
    return run


async def _run_name_param(run: Annotated[str, Path(description="run directory name under the checkpoint root")]) -> str:
    return run_name(run)


# scope="function": commit before the response is sent. With FastAPI's default ("request") the
# commit ran after the body went out, so a client could act on a 200 whose change was not yet
# visible (e.g. mark-bad, then an immediate resume still answering the bad step).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ReadScope = Annotated[str, Depends(require("read"))]
ReportScope = Annotated[str, Depends(require("report"))]
AdminScope = Annotated[str, Depends(require("admin"))]
RunName = Annotated[str, Depends(_run_name_param)]
