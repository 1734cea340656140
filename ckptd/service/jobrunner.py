"""``JobRunner``: the daemon's background jobs (re-verification, conversions), one at a time on
its own thread ``ckptd-jobs``, with progress, stall detection, cancellation and a bounded close.

Cancellation (``cancel(job_id)``, ``POST /v1/jobs/{id}/cancel``) is cooperative: a queued job is
taken off the queue and failed at once; a running one fails at its next progress report (the
runner's progress callback raises :class:`JobCancelled`, which unwinds the work like any error: a
conversion's temp tree is removed by its own cleanup, its row failed). ``close()`` asks the running
job to stop the same way before it waits ``close_timeout`` for it. Only this process's jobs can be
cancelled here: another daemon's or ``ckptd convert``'s run in their own process.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import threading
import time
from typing import Any, Callable

from sqlalchemy.orm import Session, sessionmaker

from ckptd.catalog import jobrows, repo
from ckptd.catalog.models import Job
from ckptd.errors import CkptdError
from ckptd.service.catalog import NotFoundError, get_run
from ckptd.service.jobs import (
    ACTIVE, HEARTBEAT_INTERVAL, Heartbeat, job_dict, job_meta, process_owner, record_job, reverify, running_job,
    select_shards,
)

log = logging.getLogger("ckptd.jobs")

Work = Callable[[Callable[[int, int], None]], dict[str, Any]]


class JobCancelled(CkptdError):
    """Raised from a job's progress report once the job was asked to stop."""

    code = "cancelled"
    default_hint = ""  # the message is the whole story: who stopped it and when


class JobConflictError(CkptdError):
    """The job cannot be cancelled here: it has ended, or another process runs it (HTTP 409)."""

    code = "conflict"


BY_OPERATOR_QUEUED = "cancelled by an operator before it ran"
BY_OPERATOR_RUNNING = "cancelled by an operator while it ran"
SHUTDOWN_RUNNING = "interrupted by shutdown: ckptd stopped while the job ran"
_CANCELLED = "cancelled: ckptd stopped before the job ran"


class JobRunner:
    """Runs jobs one at a time (they must not starve live ingest) on its own thread, ``ckptd-jobs``.

    A job may wedge — a read on a hung file system, a catalog row another client keeps locked —
    and must not wedge the service with it: :meth:`stalled` names the thread once the running job
    reported no progress for a while (``/healthz`` answers 503), and :meth:`close` is bounded. The
    thread is a daemon thread (a ThreadPoolExecutor's is joined at interpreter exit, forever)."""

    THREAD = "ckptd-jobs"

    def __init__(self, sessions: sessionmaker[Session], examine_many, verify_shards, check_step,  # noqa: ANN001
                 *, node: str | None = None, heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 owner: Callable[[], repo.Owner] = lambda: repo.LOCAL, close_timeout: float = 10.0) -> None:
        self.sessions = sessions
        self._examine, self._verify, self._check_step = examine_many, verify_shards, check_step
        self._nodes = owner  # this daemon's view of which files it may judge (catalog.nodes.NodeView.owner)
        self.owner = process_owner(node)
        self._heartbeat = Heartbeat(sessions, heartbeat_interval)
        self._close_timeout = close_timeout
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, Work]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._running: int | None = None  # the job on the thread, and when it last made progress
        self._progress_at = 0.0
        self._stop_reason: dict[int, str] = {}  # running job -> why it must stop at its next report

    def start_verify(self, run_name: str, step: int | None) -> dict[str, Any]:
        with self.sessions() as s:
            _, shards = select_shards(s, run_name, step)

        def work(progress: Callable[[int, int], None]) -> dict[str, Any]:
            return reverify(self.sessions, self._examine, self._verify, self._check_step, shards, progress,
                            owner=self._nodes)

        return self.start("verify", run_name, {"run": run_name, "step": step}, len(shards), work)

    def start(self, kind: str, run_name: str, params: dict[str, Any], total: int, work: Work) -> dict[str, Any]:
        """Record a queued job and run ``work(progress)`` on the runner thread."""
        with self.sessions.begin() as s:
            run = get_run(s, run_name)
            doc = job_dict(record_job(s, kind, run.id, params, self.owner, total=total))
        with self._cond:
            closed = self._closed
            if not closed:
                self._heartbeat.add(doc["id"])  # queued jobs too: another daemon must see this process alive
                self._queue.append((doc["id"], work))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self.THREAD, daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        if closed:
            self._end(doc["id"], error=_CANCELLED)
            doc |= {"state": "failed", "error": _CANCELLED}
        return doc

    def _set(self, job_id: int, **values: Any) -> None:
        with self.sessions.begin() as s:
            job = s.get(Job, job_id)
            for k, v in values.items():
                setattr(job, k, v)

    def _end(self, job_id: int, *, state: str = "failed", **values: Any) -> None:
        """Finish a job that is still queued or running: the first end wins (a job close() gave up
        on may still finish later; it must not overwrite 'interrupted by shutdown')."""
        with self.sessions.begin() as s:
            jobrows.end_job(s, job_id, ACTIVE, state=state, **values)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job_id, work = self._queue.popleft()
                self._running, self._progress_at = job_id, time.monotonic()
            try:
                self._run(job_id, work)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _progress(self, job_id: int, done: int, total: int) -> None:
        with self._cond:
            self._progress_at = time.monotonic()
            why = self._stop_reason.get(job_id)
        if why is not None:  # the work unwinds from here, as from any error of its own
            raise JobCancelled(why)
        self._set(job_id, done=done, total=total)

    def _run(self, job_id: int, work: Work) -> None:
        with running_job(job_id):
            try:
                self._set(job_id, state="running")
                result = work(functools.partial(self._progress, job_id))
                self._end(job_id, state="done", result=json.dumps(result, default=str))
            except CkptdError as exc:
                self._end(job_id, error=str(exc))
            except Exception as exc:  # recorded on the job for the operator; the runner lives on
                log.exception("job %s failed", job_id)
                self._end(job_id, error=f"{exc.__class__.__name__}: {exc}")
            finally:
                self._heartbeat.discard(job_id)
                with self._cond:
                    self._stop_reason.pop(job_id, None)

    def cancel(self, job_id: int) -> dict[str, Any]:
        """Cancel a job of this process: a queued one now (its document says ``failed``), a running
        one at its next progress report (``cancel_requested``: true). :class:`NotFoundError` for
        no such job, :class:`JobConflictError` for one that ended or that another process runs."""
        with self._cond:
            queued = next((entry for entry in self._queue if entry[0] == job_id), None)
            if queued is not None:
                self._queue.remove(queued)
            running = self._running == job_id
            if running:
                self._stop_reason.setdefault(job_id, BY_OPERATOR_RUNNING)
        if queued is not None:
            self._heartbeat.discard(job_id)
            self._end(job_id, error=BY_OPERATOR_QUEUED)
        with self.sessions() as s:
            job = s.get(Job, job_id)
            if job is None:
                raise NotFoundError(f"no job {job_id}")
            doc = job_dict(job)
            owner = job_meta(job).get("owner") or {}
        if running or queued is not None:
            return doc | {"cancel_requested": running}
        if doc["state"] not in ACTIVE:
            raise JobConflictError(f"job {job_id} has already ended ({doc['state']})", hint="nothing to cancel")
        raise JobConflictError(
            f"job {job_id} is run by another process (pid {owner.get('pid')} on {owner.get('node') or owner.get('host')})",
            hint="cancel it through the ckptd that runs it (its own API), or stop that process")

    def stalled(self, seconds: float) -> dict[str, float]:
        """The runner thread, if its job reported no progress for longer than ``seconds``."""
        with self._cond:
            age = time.monotonic() - self._progress_at
            return {self.THREAD: age} if self._running is not None and age > seconds else {}

    def close(self) -> None:
        """Stop, in bounded time: queued jobs fail as cancelled; a job still running after
        ``close_timeout`` fails as interrupted (its thread dies with the process; a restart's
        :func:`recover_abandoned` fails its conversion and removes its temp data)."""
        with self._cond:
            self._closed = True
            queued = [job_id for job_id, _ in self._queue]
            self._queue.clear()
            if self._running is not None:  # stop at its next progress report, well within the bound
                self._stop_reason.setdefault(self._running, SHUTDOWN_RUNNING)
            self._cond.notify_all()
            thread = self._thread
        for job_id in queued:  # queued behind the last job when ckptd stopped: it never ran
            self._record_end(job_id, _CANCELLED)
        if thread is not None:
            thread.join(self._close_timeout)
        with self._cond:
            running = self._running
        if running is not None:
            log.warning("job %s still running after %g s of shutdown; stopping without it", running,
                        self._close_timeout)
            self._record_end(running, SHUTDOWN_RUNNING)
        self._heartbeat.close()

    def _record_end(self, job_id: int, why: str) -> None:
        try:
            self._end(job_id, error=why)
        except Exception:
            log.warning("could not record job %s as ended (the next start fails it)", job_id, exc_info=True)
