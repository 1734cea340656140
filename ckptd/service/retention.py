"""Retention (``ckptd gc``): apply a :class:`RetentionPolicy`, deleting in two crash-safe phases.

1. mark: the planned steps go to state ``deleting`` in one transaction (re-planned under the
   catalog's locks, so a step that became newest-restorable meanwhile is not taken);
2. delete the shard files (only through :mod:`ckptd.storage`: never through a symlinked file or
   directory, so a planted link cannot make gc delete another run's files);
3. delete the rows — unless a file was refused: then the step stays ``deleting`` with the
   refusal as its ``reason``, for an operator to look at. A crash between 1 and 3 leaves steps in ``deleting``; ``finish_pending``
   (run at daemon start and by every gc) completes them.

A step re-saved under a newer layout has history rows (``kind = 'superseded'``, see
:mod:`ckptd.states`) holding the files the old layout left in the step's place. Plans never see
them (they read ``trained`` steps), so they can never keep a step alive; they are marked together
with their step and so deleted with it, files included.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.catalog import copies, objrows, removal, repo
from ckptd.catalog.models import Run
from ckptd.policy import RetentionPolicy
from ckptd.runlayout import sidecar_for
from ckptd.service.resume import step_infos
from ckptd.states import ShardState, StepState, Tier
from ckptd.storage import ConfinementError, PosixStorage


@dataclass
class GcReport:
    dry_run: bool
    plans: list[dict[str, Any]] = field(default_factory=list)
    deleted_steps: int = 0
    deleted_files: int = 0
    refused: list[str] = field(default_factory=list)
    #: torn temp files (a save killed mid-write) removed -- or, in a dry run, that would be
    torn_temps: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "runs": self.plans,
            "deleted_steps": self.deleted_steps,
            "deleted_files": self.deleted_files,
            "refused": self.refused,
            "torn_temps": self.torn_temps,
        }


def lineage_ids(s: Session) -> set[int]:
    """Steps a running conversion is reading (finished copies are deleted together with their source)."""
    return removal.conversion_source_ids(s)


def plan_run(s: Session, run: Run, policy: RetentionPolicy) -> tuple[list[int], dict[str, Any]]:
    now = datetime.now(timezone.utc)
    lineage = lineage_ids(s)
    on_objects = copies.whole_steps(s, run.id, Tier.OBJECT, set())
    # a step whose files are gone but whose objects are whole is object retention's, not this plan's
    infos = [i if i.id not in lineage else _with_in_use(i) for i in step_infos(s, run.id, now)
             if not (i.state == StepState.DELETED.value and i.id in on_objects)]
    plan = policy.plan(infos)
    by_id = {i.id: i for i in infos}
    doc = {
        "run": run.name,
        "delete": sorted((by_id[i].step for i in plan.delete), reverse=True),
        "keep": {str(by_id[i].step): why for i, why in sorted(plan.keep.items(), key=lambda kv: -by_id[kv[0]].step)},
    }
    return list(plan.delete), doc


def _with_in_use(info):  # noqa: ANN001, ANN202 - tiny dataclass helper
    from dataclasses import replace

    return replace(info, in_use=True)


def gc(
    sessions: sessionmaker[Session], store: PosixStorage, policy: RetentionPolicy, *, run_name: str | None = None, dry_run: bool = False,
    owner: repo.Owner = repo.LOCAL, torn_grace: float | None = None, progress: Callable[[int, int], None] | None = None,
) -> GcReport:
    """Apply ``policy``: plan and mark (phase 1, one transaction), then delete the files and rows
    (phases 2 and 3, :func:`finish_pending`; a process dying in between leaves the marks, which
    the next gc or daemon start finishes). ``torn_grace``: also remove torn temp files untouched
    for that many seconds (:func:`sweep_torn_temps`). ``progress(done, total)``: steps whose
    deletion (phases 2 and 3) is done."""
    report = GcReport(dry_run=dry_run)
    if not dry_run:
        finish_pending(sessions, store, report, owner, progress)
    mark_for_deletion(sessions, policy, report, run_name=run_name)
    if not dry_run:
        finish_pending(sessions, store, report, owner, progress)
    if torn_grace is not None:
        sweep_torn_temps(sessions, store, torn_grace, report, run_name=run_name)
    return report


def sweep_torn_temps(sessions: sessionmaker[Session], store: PosixStorage, grace: float, report: GcReport, *,
                     run_name: str | None = None) -> None:
    """Remove the temp files of saves that never finished (``<shard>.tmp`` of a rank killed while
    MindSpore's async writer ran): no restart ever renames them, and ``keep_checkpoint_max`` only
    rotates finished files of the current prefix. A temp file is torn once untouched for ``grace``
    seconds (a writer at work keeps writing it); only shard-named ones inside a run's shard
    directories, each removed through the confined store, refusals reported."""
    with sessions() as s:
        run_paths = removal.run_paths(s, run_name)
    before = time.time() - grace
    for run_path in run_paths:
        for d in runlayout.shard_dirs(run_path).shard_dirs:
            try:
                names = store.list(d)
            except (OSError, ConfinementError):
                continue  # gone or replaced since it was listed: the next rescan judges it
            for name in sorted(names):
                if not runlayout.is_torn_temp_name(name):
                    continue
                path = os.path.join(d, name)
                try:
                    old = store.delete_if_older(path, before, dry_run=report.dry_run)
                except FileNotFoundError:
                    continue
                except ConfinementError as err:
                    report.refused.append(f"{path}: {err.message}; not deleted")
                    continue
                if old:
                    report.torn_temps.append(path)


def mark_for_deletion(sessions: sessionmaker[Session], policy: RetentionPolicy, report: GcReport, *,
                      run_name: str | None = None) -> None:
    """Phase 1: plan every run (into ``report.plans``) and, unless ``report.dry_run``, mark the
    steps to delete ``deleting`` in the same transaction that planned (rows locked on PostgreSQL)."""
    with sessions.begin() as s:
        runs = removal.runs(s, run_name)
        if run_name is not None and not runs:
            from ckptd.service.catalog import NotFoundError

            raise NotFoundError(f"no run named {run_name!r} in the catalog")
        for run in runs:
            ids, doc = plan_run(s, run, policy)
            report.plans.append(doc)
            if report.dry_run or not ids:
                continue
            steps = removal.lock_steps(s, ids)
            for c in steps:
                c.state = StepState.DELETING.value
            for c in steps:  # each step's history after all steps: the lock order is step, then its history
                for h in repo.history_rows(s, c):
                    h.state = StepState.DELETING.value


def _remove_step_dirs(store: PosixStorage, dirs: set[str]) -> None:
    """A step that is a directory (a Checkpoint 2.0 iteration): once its files are gone, so is it
    (MindFormers' own rotation rmtrees it). Only an empty one: anything else in it is not ours to delete."""
    for d in sorted(dirs):
        if runlayout.is_step_dir(store.root, d):
            with contextlib.suppress(OSError):  # ConfinementError included: a symlink is not ours either
                store.remove_dir(d)


def delete_derived(s: Session, ckpt_id: int, store: PosixStorage, refused: list[str]) -> list[str]:
    """Rows and files of the converted copies of a step that retention is deleting (a copy never
    outlives its source: its lineage would point nowhere). A copy whose directory is refused
    (a symlink, or outside the root) keeps its rows with the refusal as reason, and the refusal
    is appended to ``refused``: the caller must then keep the source's rows too."""
    removed = []
    for copy in removal.copies_of(s, ckpt_id):
        dirs = {os.path.dirname(os.path.dirname(p)) for p in removal.all_shard_paths(s, copy.id)}
        why = [w for w in (_refused(store.remove_tree, d) for d in sorted(dirs)) if w]
        removed += [d for d in dirs if not store.exists(d)]
        if why:
            copy.reason = "; ".join(why)
            refused += why
            continue
        removal.delete_conversions_writing(s, copy.id)
        removal.delete_checkpoint_rows(s, copy.id)
    removal.delete_conversions_reading(s, ckpt_id)
    return removed


def _refused(remove: Callable[[str], None], path: str) -> str | None:
    """``remove(path)``; why not, if confinement refused it (a missing file is no refusal)."""
    try:
        remove(path)
    except FileNotFoundError:
        pass
    except ConfinementError as err:
        return f"{path}: {err.message}; not deleted"
    return None


def finish_pending(sessions: sessionmaker[Session], store: PosixStorage, report: GcReport | None = None,
                   owner: repo.Owner = repo.LOCAL, progress: Callable[[int, int], None] | None = None) -> int:
    """Phases 2 and 3 for every step left in ``deleting`` (also after a crash).

    Each node deletes only its own files (``owner``: docs/ARCHITECTURE.md, *Nodes*) and records
    them as deleted; the rows go once no node holds a file of the step any more. A step whose
    files live on several nodes is finished by the last of them (each daemon runs this at start,
    with every gc and after each heartbeat)."""
    report = report or GcReport(dry_run=False)
    with sessions() as s:
        pending = removal.deleting_step_ids(s)
    for done, ckpt_id in enumerate(pending):
        if progress is not None:
            progress(done, len(pending))  # before each step: the loop's `continue`s need no report of their own
        with sessions() as s:
            rows = removal.shard_rows(s, ckpt_id)
        refused, mine = [], []
        for shard_id, path, node, state in rows:
            if state == ShardState.DELETED.value and node != owner.node:
                continue  # its node removed it already
            if not (owner.may_judge_gone(node) or (node is None and store.exists(path))):
                continue  # another node's file: that node deletes it
            for target in (path, sidecar_for(path)):
                if not store.exists(target):
                    continue
                why = _refused(store.delete, target)  # a missing file is no refusal
                if why:
                    refused.append(why)
                else:
                    report.deleted_files += 1
            mine.append(shard_id)
        if refused:
            _keep_with_reason(sessions, ckpt_id, refused, report)
            continue  # keep the rows: an operator must look at this step
        if mine:
            with sessions.begin() as s:
                removal.mark_shards_deleted(s, mine)
            _remove_step_dirs(store, {os.path.dirname(path) for _, path, _, _ in rows})
        with sessions() as s:
            left = removal.nodes_still_holding(s, ckpt_id)
        if left:
            continue  # other nodes still hold files of it; the last one to delete removes the rows
        with sessions.begin() as s:
            refused = []
            report.deleted_files += len(delete_derived(s, ckpt_id, store, refused))
            # the files were one copy: a step whole on the object tier keeps its rows and objects
            # (object retention decides about those: gc never deletes a step's last verified copy)
            if not refused and not objrows.files_gone_keep(s, ckpt_id):
                removal.delete_checkpoint_rows(s, ckpt_id)
        if refused:
            _keep_with_reason(sessions, ckpt_id, refused, report)
            continue
        report.deleted_steps += 1
    if progress is not None and pending:
        progress(len(pending), len(pending))
    return len(pending)


def _keep_with_reason(sessions: sessionmaker[Session], ckpt_id: int, refused: list[str], report: GcReport) -> None:
    """A step gc could not fully delete stays ``deleting`` and says why (each gc retries it)."""
    report.refused += refused
    with sessions.begin() as s:
        removal.set_reason(s, ckpt_id, "; ".join(refused)[:2000])
