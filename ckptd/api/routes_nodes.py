"""Nodes: every daemon sharing the catalog, its liveness and the shards it owns."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ckptd.api.deps import ReadScope, SessionDep
from ckptd.api.errors import responses
from ckptd.service import catalog

router = APIRouter(tags=["nodes"], responses=responses(401, 403, 422))  # the error answers, for the OpenAPI document


@router.get("/v1/nodes")
def list_nodes(request: Request, s: SessionDep, _: ReadScope) -> list[dict[str, Any]]:
    """Each node: reachable (heartbeat within ``node_timeout``), seconds since its heartbeat,
    and its shards per state."""
    return catalog.list_nodes(s, request.app.state.settings.node_timeout)

