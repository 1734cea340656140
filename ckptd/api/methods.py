"""Which methods a path allows: ``OPTIONS`` answers and every 405's ``Allow`` header.

Starlette answers a method a route lacks from the *first* route whose path matches, so a path
served by two routes (``GET`` and ``POST /v1/runs/{run}/conversions``, ``POST`` and ``DELETE
/v1/runs/{run}/health``) advertised only one of them. Here the answer is the union over every
route of the path, computed from the application's own routes (no second table to keep in step).
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send


class MethodTable:
    """``routes``: every route of the application as declared (the routers' routes carry their
    prefixes; ``app.routes`` nests included routers), built once by ``create_app``."""

    def __init__(self, routes: Iterable[BaseRoute]) -> None:
        self.routes = [(route.path_regex, frozenset(route.methods)) for route in routes
                       if getattr(route, "path_regex", None) is not None and getattr(route, "methods", None)]

    def allowed(self, path: str) -> frozenset[str]:
        """Every method some route of ``path`` serves, OPTIONS included (empty: no route has that path)."""
        found = frozenset().union(*(methods for regex, methods in self.routes if regex.match(path)))
        return found | {"OPTIONS"} if found else found

    def allow_header(self, path: str) -> str:
        return ", ".join(sorted(self.allowed(path)))


class OptionsAnswer:
    """ASGI middleware: ``OPTIONS`` on a path the API serves is ``204`` with ``Allow`` (no token:
    it reveals only what the OpenAPI document says); any other path goes on (404)."""

    def __init__(self, app: ASGIApp, table: MethodTable) -> None:
        self.app, self.table = app, table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS" and self.table.allowed(scope["path"]):
            await send({"type": "http.response.start", "status": 204,
                        "headers": [(b"allow", self.table.allow_header(scope["path"]).encode("ascii"))]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)
