"""``RequestGuard``: who may send a body, and how much of one, decided before a byte of it is read.

FastAPI reads (and parses) a request's whole body before it solves the route's dependencies, so
the bearer-token check used to run after a body of any size had been buffered: a 300 MB POST
without a token grew the server by ~880 MB before its 401. This ASGI middleware runs first for
every request that may carry a body (any method but GET/HEAD/OPTIONS, which no route reads):

1. a header that grants nothing (missing or unknown token, with tokens configured) is answered 401
   at once; the body is never received;
2. a declared ``Content-Length`` above the route's limit is answered 413 at once;
3. otherwise the body is received here up to the limit (413 as soon as a chunked body passes it)
   and handed to the application in one piece.

Limits are per route: ``max_body(n)`` in a route's ``openapi_extra`` (shown in the OpenAPI
document as ``x-max-body-bytes``), ``DEFAULT_MAX_BODY`` otherwise -- every body of this API is a
small JSON object. Memory per request is thus bounded by the limit, not by what a client sends.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd.api.deps import token_scope, unauthorized
from ckptd.api.errors import body as error_body

DEFAULT_MAX_BODY = 64 * 1024
_NO_BODY = frozenset({"GET", "HEAD", "OPTIONS"})
_LIMIT_KEY = "x-max-body-bytes"


def max_body(n: int) -> dict[str, Any]:
    """``openapi_extra`` for a route accepting bodies of at most ``n`` bytes."""
    return {_LIMIT_KEY: n}


class RequestGuard:
    """``routes``: the application's routes as its routers declared them (their paths carry the
    routers' prefixes), to find a request's route and limit without FastAPI's own routing."""

    def __init__(self, app: ASGIApp, routes: Iterable[BaseRoute]) -> None:
        self.app = app
        self.limits = [(route.path_regex, frozenset(route.methods or ()),
                        int((getattr(route, "openapi_extra", None) or {}).get(_LIMIT_KEY, DEFAULT_MAX_BODY)))
                       for route in routes if getattr(route, "path_regex", None) is not None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _NO_BODY:
            await self.app(scope, receive, send)
            return
        application = scope["app"]
        limit = self._limit_for(scope["method"], scope["path"])
        if limit is None:  # no route of that path and method: answered 404/405 without reading a body
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # last value wins; h11 already refused duplicate lengths
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        if token_scope(application.state.tokens, authorization) is None:
            exc = unauthorized(authorization)
            await _answer(send, exc.status_code, {"detail": exc.detail}, exc.headers)
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(send, limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _too_large(send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, None, receive), send)

    def _limit_for(self, method: str, path: str) -> int | None:
        for regex, methods, limit in self.limits:
            if method in methods and regex.match(path):
                return limit
        return None


def _replay(chunks: list[bytes], first: Message | None, receive: Receive) -> Receive:
    pending: list[Message] = [first] if first is not None else [
        {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()  # then: http.disconnect, as before

    return replay


async def _too_large(send: Send, limit: int) -> None:
    await _answer(send, 413, error_body("payload_too_large", f"request body larger than {limit} bytes",
                                        "this route takes a small JSON object"), {"Connection": "close"})


async def _answer(send: Send, status: int, doc: dict[str, Any], headers: dict[str, str] | None) -> None:
    payload = json.dumps(doc).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
