"""Request dependencies as ``Annotated`` aliases: the catalog session, the caller's scope, the daemon,
and the typed path parameters (bounded so that every value the schema admits fits the catalog)."""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from ckptd.api.schemas import INT32_MAX, INT64_MAX

SCOPE_RANK = {"read": 0, "report": 1, "admin": 2}

#: A run name: letters, digits, '.', '_', '-'; starts with a letter or digit; never '..'; at most
#: 255 characters. Written without look-arounds so it means the same in ECMA regexes (OpenAPI),
#: pydantic's and Python's; checked with ``fullmatch`` (``re.match`` + ``$`` let "run1\n" through).
RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*\.?$"
RUN_NAME_MAX = 255
_RUN_RE = re.compile(RUN_NAME)

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <token>`; scopes read < report < admin")


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


def unauthorized(authorization: str) -> HTTPException:
    """The 401 for a header that grants nothing (one wording for the guard and the routes)."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        detail = {"code": "unauthorized", "message": "missing bearer token", "hint": "send 'Authorization: Bearer <token>'"}
    else:
        detail = {"code": "unauthorized", "message": "unknown token", "hint": "check the token"}
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})


def valid_run_name(run: str) -> bool:
    # run names come from directory names; anything else (.., slashes, NUL, newlines) never names a run
    return len(run) <= RUN_NAME_MAX and _RUN_RE.fullmatch(run) is not None


_QUERY_NAMES: dict[int, frozenset[str]] = {}  # id(route) -> the query parameters it declares


async def known_query_only(request: Request) -> None:
    """Refuse (422) a query parameter the route does not declare: a misspelt ``max_stpe=10`` must
    not be answered as if it were absent. Every route gets it (``create_app``)."""
    if not request.scope.get("query_string"):
        return
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    known = _QUERY_NAMES.get(id(route))
    if known is None:
        known = _QUERY_NAMES[id(route)] = frozenset(_query_names(dependant))
    unknown = sorted(set(request.query_params.keys()) - known)
    if unknown:
        raise RequestValidationError([{"loc": ("query", name), "msg": "unknown query parameter", "type": "extra_forbidden"}
                                      for name in unknown])


def _query_names(dependant) -> Iterator[str]:  # noqa: ANN001 - fastapi.dependencies.models.Dependant
    yield from (p.alias for p in dependant.query_params)
    for sub in dependant.dependencies:
        yield from _query_names(sub)


def _scope(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scope = token_scope(request.app.state.tokens, header)
    if scope is None:
        raise unauthorized(header)
    return scope


def require(minimum: str):
    # async on purpose (here and in _run_name_param): pure CPU, so FastAPI runs them inline instead of
    # sending each to the thread pool. _bearer only documents the scheme in OpenAPI (its parsing is
    # not used: token_scope reads the header itself, as the resume fast path does).
    async def check(request: Request, _: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> str:
        scope = _scope(request)
        if SCOPE_RANK[scope] < SCOPE_RANK[minimum]:
            raise HTTPException(403, {"code": "forbidden", "message": f"this needs the {minimum!r} scope, token has {scope!r}",
                                      "hint": "use a token with a higher scope"})
        return scope

    return check


def run_name(run: str) -> str:
    if not valid_run_name(run):
        raise HTTPException(400, {"code": "invalid_run_name", "message": f"{run!r} is not a valid run name",
                                  "hint": "letters, digits, '.', '_' and '-' only, starting with a letter or digit, "
                                          "no '..', at most 255 characters"})
    return run


async def _run_name_param(
    run: Annotated[str, Path(
        description="run directory name under the checkpoint root (an invalid name is answered 400 invalid_run_name)",
        json_schema_extra={"pattern": RUN_NAME, "maxLength": RUN_NAME_MAX},
    )],
) -> str:
    return run_name(run)


# scope="function": commit before the response is sent. With FastAPI's default ("request") the
# commit ran after the body went out, so a client could act on a 200 whose change was not yet
# visible (e.g. mark-bad, then an immediate resume still answering the bad step).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ReadScope = Annotated[str, Depends(require("read"))]
ReportScope = Annotated[str, Depends(require("report"))]
AdminScope = Annotated[str, Depends(require("admin"))]
RunName = Annotated[str, Depends(_run_name_param)]
Step = Annotated[int, Path(ge=0, le=INT64_MAX, description="training step (the global step the files record)")]
JobId = Annotated[int, Path(ge=1, le=INT32_MAX, description="job id, as POST answers returned it")]
