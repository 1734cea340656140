"""Training-health reports from the trainer, and the operator's way to clear them.

``report`` accepts a report for a run the catalog has, or whose directory exists under the
checkpoint root (a trainer reports from its first step, before its first save, into a directory
its launcher already created); for any other name it refuses, so a ``report`` token cannot make
ckptd invent runs. ``clear`` removes a run's records from a step on: one wrong NaN would otherwise
rule out every checkpoint after it for good.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy.orm import Session

from ckptd.catalog import reads
from ckptd.catalog.repo import get_or_create_run
from ckptd.service.catalog import NotFoundError, get_run, report_health
from ckptd.storage import PosixStorage


def report(s: Session, store: PosixStorage, run_name: str, step: int, loss: float | None, grad_norm: float | None,
           overflow: bool) -> None:
    if reads.run_named(s, run_name) is None:
        path = os.path.join(store.root, run_name)  # a validated name: no separators, never ".."
        if not store.is_dir(path):  # a directory itself, not a symlink to one
            raise NotFoundError(
                f"ckptd has not seen a run named {run_name!r}: {path} is not a directory",
                hint="health is reported for a run's directory under the checkpoint root; create it (the trainer's "
                     "launcher does) or check the run name",
            )
        get_or_create_run(s, run_name, path)
    report_health(s, run_name, step, loss, grad_norm, overflow)


def clear(s: Session, run_name: str, from_step: int | None = None) -> dict[str, Any]:
    """Remove the run's health records at or after ``from_step`` (all of them when None)."""
    run = get_run(s, run_name)
    removed, nonfinite = reads.delete_health(s, run.id, from_step)
    return {"run": run_name, "from_step": from_step, "removed": removed, "nonfinite_removed": nonfinite}
