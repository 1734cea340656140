"""Background jobs with progress stored in the catalog (``jobs`` table): re-verification for now.

Call order: ``JobRunner(sessions, examine_many, verify_shards, check_step)`` → ``start_verify(...)``
returns the job immediately → poll ``get_job`` → ``close()``. The verification itself runs
synchronously, a chunk of shards at a time, on the runner's own thread (one job at a time: jobs
must not starve live ingest).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ckptd.catalog.models import Checkpoint, Job, Run, Shard
from ckptd.errors import CkptdError
from ckptd.service.catalog import NotFoundError, _iso, get_run, get_step
from ckptd.states import ShardState

log = logging.getLogger("ckptd.jobs")


def job_dict(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "kind": job.kind,
        "state": job.state,
        "total": job.total,
        "done": job.done,
        "progress": (job.done / job.total) if job.total else (1.0 if job.state == "done" else 0.0),
        "params": json.loads(job.params) if job.params else None,
        "result": json.loads(job.result) if job.result else None,
        "error": job.error,
        "created_at": _iso(job.created_at),
        "updated_at": _iso(job.updated_at),
    }


def get_job(s: Session, job_id: int) -> dict[str, Any]:
    job = s.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"no job {job_id}")
    return job_dict(job)


def list_jobs(s: Session, limit: int = 100) -> list[dict[str, Any]]:
    return [job_dict(j) for j in s.execute(select(Job).order_by(Job.id.desc()).limit(limit)).scalars()]


def select_shards(s: Session, run_name: str, step: int | None) -> tuple[Run, list[tuple[int, str, int]]]:
    run = get_run(s, run_name)
    q = select(Shard.id, Shard.path, Shard.checkpoint_id).join(Checkpoint, Shard.checkpoint_id == Checkpoint.id).where(
        Checkpoint.run_id == run.id,
        Shard.state.notin_((ShardState.DELETED.value, ShardState.SUPERSEDED.value)),  # history rows are no steps
    )
    if step is not None:
        q = q.where(Checkpoint.id == get_step(s, run, step).id)
    return run, [tuple(r) for r in s.execute(q.order_by(Checkpoint.step, Shard.rank)).all()]


_CHUNK = 64  # shards re-examined and re-verified per round (one transaction per checkpoint each)


def reverify(
    sessions: sessionmaker[Session],
    examine_many: Callable[[list[str]], dict[str, str]],
    verify_shards: Callable[[list[int]], dict[int, Any]],
    check_step: Callable[[int], list[str]],
    shards: list[tuple[int, str, int]],
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> dict[str, Any]:
    """Re-examine and re-verify shards, then re-run the step checks. Returns a summary."""
    states: dict[str, int] = {}
    for start in range(0, len(shards), _CHUNK):
        chunk = shards[start : start + _CHUNK]
        examine_many([path for _, path, _ in chunk])  # picks up replaced/vanished files first
        verdicts = verify_shards([shard_id for shard_id, _, _ in chunk])
        for shard_id, _, _ in chunk:
            state = verdicts.get(shard_id)
            key = state.value if state is not None else "skipped"
            states[key] = states.get(key, 0) + 1
        progress(start + len(chunk), len(shards))
    step_problems = {}
    for ckpt_id in sorted({c for _, _, c in shards}):
        with sessions.begin() as s:
            ckpt = s.get(Checkpoint, ckpt_id)
            if ckpt is None:
                continue
            ckpt.step_checks_ok, step = None, ckpt.step
        problems = check_step(ckpt_id)
        if problems:
            step_problems[str(step)] = problems
    return {"shards": states, "step_problems": step_problems}


class JobRunner:
    def __init__(self, sessions: sessionmaker[Session], examine_many, verify_shards, check_step) -> None:  # noqa: ANN001
        self.sessions = sessions
        self._examine, self._verify, self._check_step = examine_many, verify_shards, check_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-jobs")

    def start_verify(self, run_name: str, step: int | None) -> dict[str, Any]:
        with self.sessions() as s:
            _, shards = select_shards(s, run_name, step)

        def work(progress: Callable[[int, int], None]) -> dict[str, Any]:
            return reverify(self.sessions, self._examine, self._verify, self._check_step, shards, progress)

        return self.start("verify", run_name, {"run": run_name, "step": step}, len(shards), work)

    def start(self, kind: str, run_name: str, params: dict[str, Any], total: int,
              work: Callable[[Callable[[int, int], None]], dict[str, Any]]) -> dict[str, Any]:
        """Record a queued job and run ``work(progress)`` on the runner thread."""
        with self.sessions.begin() as s:
            run = get_run(s, run_name)
            job = Job(kind=kind, run_id=run.id, state="queued", total=total, done=0, params=json.dumps(params))
            s.add(job)
            s.flush()
            doc = job_dict(job)
        self._pool.submit(self._run, doc["id"], work)
        return doc

    def _set(self, job_id: int, **values: Any) -> None:
        with self.sessions.begin() as s:
            job = s.get(Job, job_id)
            for k, v in values.items():
                setattr(job, k, v)

    def _run(self, job_id: int, work: Callable[[Callable[[int, int], None]], dict[str, Any]]) -> None:
        self._set(job_id, state="running")
        try:
            result = work(lambda done, total: self._set(job_id, done=done, total=total))
            self._set(job_id, state="done", result=json.dumps(result, default=str))
        except CkptdError as exc:
            self._set(job_id, state="failed", error=str(exc))
        except Exception as exc:  # recorded on the job for the operator; the runner lives on
            log.exception("job %s failed", job_id)
            self._set(job_id, state="failed", error=f"{exc.__class__.__name__}: {exc}")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
