"""Fault injection for tests and the demo: ``KIND:RANK:STEP`` specs, active in one launch attempt.

* ``kill:R:S``          rank R SIGKILLs itself at the start of step S (steps < S are done);
* ``kill-in-save:R:S``  rank R SIGKILLs itself while its async save of step S is being written
                        (as soon as MindSpore's ``.tmp`` appears, so the shard never completes);
* ``hang:R:S``          rank R stops (sleeps forever, no heartbeat) at the start of step S.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

KINDS = ("kill", "kill-in-save", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    @classmethod
    def parse(cls, spec: str) -> Fault:
        try:
            kind, rank, step = spec.split(":")
            fault = cls(kind, int(rank), int(step))
        except ValueError:
            raise ValueError(f"bad fault spec {spec!r}: expected KIND:RANK:STEP") from None
        if fault.kind not in KINDS:
            raise ValueError(f"bad fault kind {fault.kind!r}: one of {', '.join(KINDS)}")
        return fault


def _die(marker: str | None) -> None:
    """SIGKILL ourselves, first leaving ``marker`` (JSON time/pid) so benchmarks know when it happened."""
    if marker:
        with open(marker, "w") as fh:
            json.dump({"time": time.time(), "pid": os.getpid()}, fh)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


class Faults:
    def __init__(self, specs: list[str], rank: int, active: bool, log, marker: str | None = None) -> None:
        self.faults = [f for f in map(Fault.parse, specs) if f.rank == rank] if active else []
        self.log, self.marker = log, marker

    def before_step(self, step: int) -> None:
        for f in self.faults:
            if f.step == step and f.kind == "kill":
                self.log(f"fault: kill rank {f.rank} at step {step}")
                _die(self.marker)
            if f.step == step and f.kind == "hang":
                self.log(f"fault: hang rank {f.rank} at step {step}")
                while True:
                    time.sleep(3600)

    def after_save_issued(self, step: int, path: str) -> None:
        for f in self.faults:
            if f.step == step and f.kind == "kill-in-save":
                tmp = os.path.splitext(path)[0] + ".tmp"
                deadline = time.monotonic() + 5.0
                while not os.path.exists(tmp) and not os.path.exists(path) and time.monotonic() < deadline:
                    time.sleep(0.0005)
                state = "tmp" if os.path.exists(tmp) else ("final" if os.path.exists(path) else "none")
                self.log(f"fault: kill rank {f.rank} during async save of step {step} (on disk: {state})")
                _die(self.marker)
