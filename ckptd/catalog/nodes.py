"""The daemons' nodes: registration, heartbeats, liveness (docs/ARCHITECTURE.md, *Nodes*).

Every daemon has a node name (``settings.node_name``). It registers at start and renews its
heartbeat every ``heartbeat_interval``; a node whose heartbeat is older than ``node_timeout`` is
*unreachable*. Liveness is computed from the catalog when asked, never stored: a node that died
cannot write "I am dead", and every daemon sharing the catalog must reach the same verdict.
"""

from __future__ import annotations

import logging
import os
import stat as stat_mod
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.catalog.models import Node, Shard, as_utc
from ckptd.catalog.repo import Owner, insert_ignore
from ckptd.atomic import atomic_write

log = logging.getLogger("ckptd.nodes")



@dataclass(frozen=True)
class NodeStatus:
    name: str
    heartbeat_at: datetime
    reachable: bool
    seconds_since_heartbeat: float
    started_at: datetime


def register(session: Session, name: str, root: str) -> None:
    """Register (or re-register) this daemon's node and renew its heartbeat. A node coming back
    changes answers that named it unreachable: every run's cached resume answer is invalidated."""
    now = datetime.now(timezone.utc)
    insert_ignore(session, Node, {"name": name, "started_at": now, "heartbeat_at": now, "pid": os.getpid(), "root": root},
                  ["name"])
    session.execute(update(Node).where(Node.name == name).values(started_at=now, heartbeat_at=now, pid=os.getpid(),
                                                                 root=root))
    session.execute(text("UPDATE resume_generations SET generation = generation + 1"))


def heartbeat(session: Session, name: str) -> None:
    session.execute(update(Node).where(Node.name == name).values(heartbeat_at=datetime.now(timezone.utc)))


def statuses(session: Session, timeout: float, now: datetime | None = None) -> dict[str, NodeStatus]:
    now = now or datetime.now(timezone.utc)
    out = {}
    for name, beat, started in session.execute(select(Node.name, Node.heartbeat_at, Node.started_at)).all():
        age = (now - as_utc(beat)).total_seconds()
        out[name] = NodeStatus(name, as_utc(beat), age <= timeout, max(0.0, age), as_utc(started))
    return out


def unreachable(session: Session, timeout: float) -> set[str]:
    """Nodes silent past ``timeout`` (a node never registered is not unreachable: its rows are
    the pre-0006 placeholder NULL, or a name nothing claims)."""
    return {n for n, st in statuses(session, timeout).items() if not st.reachable}


def next_change(session: Session, timeout: float) -> datetime | None:
    """The earliest moment a reachable node becomes unreachable if it sends no heartbeat: an
    answer that depends on liveness is valid until then."""
    beats = [st.heartbeat_at for st in statuses(session, timeout).values() if st.reachable]
    return min(beats) + timedelta(seconds=timeout) if beats else None


def write_marker(root: str, name: str) -> None:
    """Leave this node's sharing marker in its root: another node that finds it in *its* root
    watches the same filesystem, so a file of ours it cannot see is really gone (``Owner.shared``).
    A read-only root gets none (this node is then never proven to share it): logged, not fatal."""
    try:
        with atomic_write(runlayout.node_marker_path(root, name), overwrite=True) as fh:
            fh.write(f"ckptd node {name}\n".encode())
    except OSError as err:
        log.warning("cannot write the node marker in %s (%s): other nodes will not count this root as shared",
                    root, err.strerror)


def renew_marker(root: str, name: str) -> bool:
    """Write this node's marker again when it is gone from its root (the root wiped under a running
    daemon: the launcher would otherwise refuse to start a job there, ``ckptd.launcher.freshstart``).
    True when it was written."""
    if os.path.lexists(runlayout.node_marker_path(root, name)):
        return False
    log.warning("the node marker in %s was gone (the root wiped?): written again", root)
    write_marker(root, name)
    return True


def sharing(root: str, names: set[str]) -> frozenset[str]:
    """The nodes among ``names`` whose marker is in ``root`` (a regular file: a symlink planted
    there proves nothing about where its node writes)."""
    out = set()
    for name in names:
        try:
            if stat_mod.S_ISREG(os.lstat(runlayout.node_marker_path(root, name)).st_mode):
                out.add(name)
        except OSError:
            pass
    return frozenset(out)


def several(session: Session) -> bool:
    """More than one node ever registered (answers then depend on liveness)."""
    return len(session.execute(select(Node.id).limit(2)).all()) > 1


def shard_counts(session: Session) -> dict[str | None, dict[str, int]]:
    """node -> shard state -> count (``/metrics``)."""
    from sqlalchemy import func

    out: dict[str | None, dict[str, int]] = {}
    for node, state, n in session.execute(select(Shard.node, Shard.state, func.count()).group_by(Shard.node, Shard.state)):
        out.setdefault(node, {})[state] = n
    return out


class NodeView:
    """This daemon's view of ownership (``repo.Owner``), refreshed at most every ``refresh``
    seconds: the hot paths ask for it per batch, liveness moves on the scale of heartbeats."""

    def __init__(self, sessions: sessionmaker[Session], name: str, timeout: float, refresh: float = 2.0,
                 root: str | None = None) -> None:
        self.sessions, self.name, self.timeout, self.refresh = sessions, name, timeout, refresh
        self.root = root  # where the other nodes' sharing markers would be (None: no root, shares nothing)
        self._lock = threading.Lock()
        self._owner: Owner | None = None
        self._at = 0.0

    def owner(self) -> Owner:
        with self._lock:
            if self._owner is not None and time.monotonic() - self._at < self.refresh:
                return self._owner
        with self.sessions() as s:
            known = statuses(s, self.timeout)
        others = set(known) - {self.name}
        dead = frozenset(n for n in others if not known[n].reachable)
        # an upgraded multi-node catalog has unowned rows of every node; the first daemon up must
        # not call the others' gone before they had a node timeout to register (claiming rows it
        # sees needs no wait). A process that never registered (a CLI) is sole only when alone.
        me = known.get(self.name)
        settled = me is None or (datetime.now(timezone.utc) - me.started_at).total_seconds() >= self.timeout
        shared = sharing(self.root, dead) if self.root else frozenset()
        owner = Owner(self.name, dead, sole=not others and settled, shared=shared)
        with self._lock:
            self._owner, self._at = owner, time.monotonic()
        return owner
