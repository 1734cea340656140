"""Fault injection for tests and the demo: ``KIND:RANK:STEP`` specs, active in one launch attempt.

* ``kill:R:S``          rank R SIGKILLs itself at the start of step S (steps < S are done);
* ``kill-in-save:R:S``  rank R SIGKILLs itself while its async save of step S is in flight:
                        MindSpore's writer thread was started and waits for the file lock the
                        rank holds, so the shard never lands (deterministic: a small save raced
                        to completion before a kill aimed at its ``.tmp`` under load);
* ``hang:R:S``          rank R stops (sleeps forever, no heartbeat) at the start of step S;
* ``kill-in-snapshot:R:S`` rank R SIGKILLs itself in the middle of its memory-tier snapshot of step S:
                        the snapshot carries an extra 128 MiB tensor (so the copy takes a while, with
                        the GIL released), and a thread watching the slots' commit words kills the
                        rank the moment one drops to 0 (the copy has begun; it cannot have ended).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

KINDS = ("kill", "kill-in-save", "hang", "kill-in-snapshot")
#: the extra tensor a ``kill-in-snapshot`` snapshot carries
SNAPSHOT_PAD = 128 << 20


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

    def before_save(self, step: int, settle) -> None:
        """Before the save of ``step`` is issued: for ``kill-in-save``, let the previous save finish
        (``settle``) and take MindSpore's checkpoint lock, which its async writer holds for the whole
        write -- the save is then issued but cannot land before this rank dies."""
        for f in self.faults:
            if f.step == step and f.kind == "kill-in-save":
                settle()
                from mindspore.train import serialization

                serialization._ckpt_mutex.acquire()  # an RLock: save_checkpoint on this thread re-enters it

    def after_save_issued(self, step: int, path: str) -> None:
        for f in self.faults:
            if f.step == step and f.kind == "kill-in-save":
                state = "tmp" if os.path.exists(os.path.splitext(path)[0] + ".tmp") else (
                    "final" if os.path.exists(path) else "none")
                self.log(f"fault: kill rank {f.rank} during async save of step {step} (on disk: {state})")
                _die(self.marker)

    def before_snapshot(self, step: int, slot_paths: list[str]) -> list:
        """For ``kill-in-snapshot`` at ``step``: arm the killer and return the extra tensor to copy."""
        for f in self.faults:
            if f.step == step and f.kind == "kill-in-snapshot":
                import threading

                import numpy as np

                fds = [os.open(p, os.O_RDONLY) for p in slot_paths]

                def watch() -> None:
                    while True:
                        for fd in fds:
                            if os.pread(fd, 8, 8) == b"\0" * 8:
                                self.log(f"fault: kill rank {f.rank} in the middle of its snapshot of step {step}")
                                _die(self.marker)
                        time.sleep(0.0005)

                threading.Thread(target=watch, name="fault-kill-in-snapshot", daemon=True).start()
                return [("fault.pad", np.ones(SNAPSHOT_PAD // 4, np.float32))]
        return []
