"""Nodes: every daemon sharing the catalog, its liveness and the shards it owns."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session

from ckptd.api.deps import ReadScope, SessionDep
from ckptd.api.errors import responses
from ckptd.api.promtext import sample
from ckptd.catalog import nodes
from ckptd.service import catalog

router = APIRouter(tags=["nodes"], responses=responses(401, 403, 422))  # the error answers, for the OpenAPI document


@router.get("/v1/nodes")
def list_nodes(request: Request, s: SessionDep, _: ReadScope) -> list[dict[str, Any]]:
    """Each node: reachable (heartbeat within ``node_timeout``), seconds since its heartbeat,
    and its shards per state."""
    return catalog.list_nodes(s, request.app.state.settings.node_timeout)


def node_metric_lines(s: Session, timeout: float) -> list[str]:
    """``/metrics`` lines: per-node shard counts and seconds since each node's heartbeat."""
    lines = ["# HELP ckptd_node_shards Shards in the catalog by owning node and state.",
             "# TYPE ckptd_node_shards gauge"]
    for node, states in sorted(nodes.shard_counts(s).items(), key=lambda kv: str(kv[0])):
        for state, n in sorted(states.items()):
            lines.append(sample("ckptd_node_shards", n, node=node, state=state))
    lines += ["# HELP ckptd_node_heartbeat_age_seconds Seconds since each node's daemon last sent a heartbeat.",
              "# TYPE ckptd_node_heartbeat_age_seconds gauge",
              "# HELP ckptd_node_reachable 1 if the node's heartbeat is within node_timeout.",
              "# TYPE ckptd_node_reachable gauge"]
    for st in sorted(nodes.statuses(s, timeout).values(), key=lambda x: x.name):
        lines.append(sample("ckptd_node_heartbeat_age_seconds", f"{st.seconds_since_heartbeat:.3f}", node=st.name))
        lines.append(sample("ckptd_node_reachable", int(st.reachable), node=st.name))
    return lines
