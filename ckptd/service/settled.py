"""The settled barrier: has ckptd judged everything committed under a run up to now?

A launcher asks it (``GET /v1/runs/{run}/settled``) right after its job died and before it asks
where to resume: the job's last save may have been renamed into place a moment ago, and asking
the resume oracle before ckptd judged it would be answered -- safely -- with an older step, losing
work. The answer comes from ckptd's own machinery, never from parsing names, so it holds for every
layout and format (native and MindFormers ``rank_<r>/`` with ``.ckpt`` or ``.safetensors``,
Checkpoint 2.0 iterations):

1. **ingest caught up** (this node's view): a full rescan that *started after the question*
   finished (:meth:`IngestView.rescan_fence`; the rescan is the source of truth, file events only
   make ckptd fast), and no path under the run waits for its examination or is being examined
   (debounced events, files still being written that the rescan put back to wait ``settle_seconds``);
2. **every catalogued save judged**: no step of the run is ``pending`` (shards unverified, or its
   step checks not run yet), and no ``incomplete`` step has a shard without a verdict. An
   ``incomplete`` step whose files present all have theirs is judged: it waits for files that are
   not there (a rank killed mid-save), which no waiting would bring;
3. with a memory tier, a **scan of the slots** that started after the question finished: a
   crashed job's newest snapshots are in memory before any file is.

Nodes. A shard is judged by the node that saw it (docs/ARCHITECTURE.md, *Nodes*). The answer lists
per node what the catalog holds unjudged; shards of an *unreachable* node (or of no node: rows
from before nodes) do not hold the barrier -- nobody will judge them soon -- and are listed so.
What another node has on its disk but not catalogued yet is not known here: its own daemon's
barrier answers for it (point 1 is this node's view only).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout, stepname
from ckptd.catalog import nodes as node_registry
from ckptd.catalog import reads
from ckptd.service.catalog import NotFoundError
from ckptd.states import RESAVABLE_KINDS, ShardState, StepState

#: the newest steps looked at for the answer's ``steps`` (down to the newest verified one)
STEPS_SHOWN = 100
#: open steps (pending / incomplete) of one run looked into: more than any job leaves torn
OPEN_STEPS = 10_000
#: how often a waiting question looks again (seconds: first, then doubling up to the last)
POLL = (0.02, 0.25)


class IngestView(Protocol):
    """What the barrier reads of this node's ingest (:class:`ckptd.watcher.Watcher`)."""

    def rescan_fence(self) -> int: ...
    def rescanned_since(self, fence: int) -> bool: ...
    def examining(self, prefix: str) -> int: ...


class MemoryView(Protocol):
    """What the barrier reads of this node's memory tier (:class:`ckptd.service.memtier.MemoryTier`)."""

    def scan_fence(self) -> int: ...
    def scanned_since(self, fence: int) -> bool: ...


@dataclass(frozen=True)
class Barrier:
    sessions: sessionmaker[Session]
    ingest: IngestView
    root: str
    node: str
    node_timeout: float
    #: with a memory tier, a scan of the slots that started after the question must finish too:
    #: a job's newest snapshots are in memory before any file, and a crash leaves them there
    memory: MemoryView | None = None

    async def wait(self, run: str, wait: float) -> dict[str, Any]:
        """The answer for ``run``, as soon as it is settled or after ``wait`` seconds (then with
        ``settled`` false and what is outstanding). Waits without holding a thread."""
        t0 = time.monotonic()
        fence = self.ingest.rescan_fence()
        memory_fence = self.memory.scan_fence() if self.memory is not None else 0
        prefix = runlayout.run_dir(self.root, run)
        delay = POLL[0]
        while True:
            rescanned = self.ingest.rescanned_since(fence)
            examining = self.ingest.examining(prefix)  # read before the catalog: what left it is catalogued
            caught_up = rescanned and not examining and (self.memory is None or self.memory.scanned_since(memory_fence))
            out_of_time = time.monotonic() - t0 >= wait
            if caught_up or out_of_time:
                doc = await asyncio.to_thread(self.judged, run)
                if caught_up and not doc["catalogued"]:  # after the rescan: nothing under the root holds it
                    raise NotFoundError(f"no run named {run!r} in the catalog, nor under the checkpoint root",
                                        hint="nothing of this run to judge (check --run-name and ckptd's --root)")
                settled = caught_up and not any(u["blocking"] for u in doc["unjudged"])
                if settled or out_of_time:
                    return {"run": run, "settled": settled, "node": self.node,
                            "waited": round(time.monotonic() - t0, 3), "rescanned": rescanned,
                            "examining": examining, **doc}
            await asyncio.sleep(min(delay, max(0.0, wait - (time.monotonic() - t0))))
            delay = min(POLL[1], delay * 2)

    def judged(self, run_name: str) -> dict[str, Any]:
        """The catalog's half: the run's newest steps and what it holds unjudged, per node."""
        with self.sessions() as s:
            run = reads.run_named(s, run_name)
            if run is None:
                return {"catalogued": False, "steps": [], "unjudged": []}
            steps = []
            for c, seen in reads.steps_with_shards_step(s, run.id, None, STEPS_SHOWN):
                if c.kind != "trained":
                    continue
                steps.append(_step(c, seen))
                if c.state == StepState.VERIFIED.value:
                    break
            unjudged = self._unjudged(s, run.id)
        return {"catalogued": True, "steps": steps, "unjudged": unjudged}

    def _unjudged(self, s: Session, run_id: int) -> list[dict[str, Any]]:
        live = node_registry.statuses(s, self.node_timeout)
        groups: dict[str | None, dict[str, Any]] = {}
        for state in (StepState.PENDING.value, StepState.INCOMPLETE.value):
            for c, seen in reads.steps_with_shards_step(s, run_id, state, OPEN_STEPS):
                if c.kind not in RESAVABLE_KINDS:
                    continue  # a converted copy is judged by the job writing it, not by this barrier
                waiting: dict[str | None, int] = {}
                for sh in reads.shards_of(s, c.id):
                    if sh.state == ShardState.COMPLETE.value:
                        waiting[sh.node] = waiting.get(sh.node, 0) + 1
                if not waiting and state == StepState.PENDING.value:
                    waiting[self.node] = 0  # every file has its verdict, the step checks are due (a rescan runs them)
                for node, count in waiting.items():
                    g = groups.setdefault(node, {"node": node, "reachable": self._reachable(node, live),
                                                 "shards": 0, "steps": []})
                    g["shards"] += count
                    g["steps"].append(stepname.label(c.global_step, seen, c.epoch, c.step))
        for g in groups.values():
            g["blocking"] = bool(g["reachable"])
        return sorted(groups.values(), key=lambda g: (g["node"] != self.node, str(g["node"])))

    def _reachable(self, node: str | None, live: dict[str, node_registry.NodeStatus]) -> bool | None:
        if node == self.node:
            return True
        if node is None or node not in live:
            return None  # a row no registered node holds: nobody will judge it soon
        return live[node].reachable


def _step(c: Any, seen: int | None) -> dict[str, Any]:
    return {"step": c.step, "epoch": c.epoch, "training_step": stepname.users_step(c.global_step, seen, c.epoch, c.step),
            "label": stepname.label(c.global_step, seen, c.epoch, c.step), "state": c.state}
