"""Background jobs with progress stored in the catalog (``jobs`` table): re-verification, conversions.

Call order: ``JobRunner(sessions, examine_many, verify_shards, check_step)`` → ``start_verify(...)``
returns the job immediately → poll ``get_job`` → ``close()``. The verification itself runs
synchronously, a chunk of shards at a time, on the runner's own thread (one job at a time: jobs
must not starve live ingest).

Ownership and liveness. A job row names the process that runs it, in ``params["ckptd"]["owner"]``
(:func:`process_owner`: node, host, pid, the pid's start time, boot id and PID namespace), and
that process renews the row's ``updated_at`` every ``heartbeat_interval`` while the job is queued
or running (:class:`Heartbeat`). A conversion is tied to its job (``params["ckptd"]
["conversion_id"]``; ``ckptd convert --run`` records a job of its own). :func:`recover_abandoned`
(at daemon start, and periodically) fails the queued/running jobs whose process is gone, then the
conversions of those jobs, and removes their temp data (:mod:`ckptd.service.conversions`). A
process is *gone* (:func:`owner_gone`):

* on this machine, in this PID namespace (same boot id and ``/proc/self/ns/pid``): when its pid is
  not running, is a zombie, or started at another time (the pid was reused) — exact, at once;
* anywhere else (another node, another container): when it renewed nothing for ``timeout``
  seconds (the daemon's ``node_timeout``). A live process elsewhere keeps renewing, so a daemon
  sharing the catalog never fails another daemon's or ``ckptd convert``'s work; the nodes' clocks
  must agree to well within ``timeout``;
* a row without an owner (written before ckptd recorded one): no update for
  ``LEGACY_ABANDON_AFTER`` (the conversion lease: its source was no longer protected anyway).
"""

from __future__ import annotations

import collections
import contextvars
import functools
import json
import logging
import os
import socket
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from ckptd.catalog import repo
from ckptd.catalog.models import Checkpoint, Job, Run, Shard, as_utc
from ckptd.errors import CkptdError
from ckptd.service.catalog import NotFoundError, iso_time, get_run, get_step
from ckptd.states import ShardState

log = logging.getLogger("ckptd.jobs")

ACTIVE = ("queued", "running")  # job and conversion states a live process is responsible for
HEARTBEAT_INTERVAL = 10.0  # s, the default of settings.heartbeat_interval
ABANDON_TIMEOUT = 120.0  # s, the default of settings.node_timeout
LEGACY_ABANDON_AFTER = timedelta(hours=2)  # = conversions.CONVERT_LEASE
_META = "ckptd"  # the params key of what ckptd records about a job itself (owner, conversion id)


def job_dict(job: Job) -> dict[str, Any]:
    params = json.loads(job.params) if job.params else None
    meta = params.pop(_META, None) if isinstance(params, dict) else None
    doc = {
        "id": job.id,
        "kind": job.kind,
        "state": job.state,
        "total": job.total,
        "done": job.done,
        "progress": (job.done / job.total) if job.total else (1.0 if job.state == "done" else 0.0),
        "params": params,
        "result": json.loads(job.result) if job.result else None,
        "error": job.error,
        "created_at": iso_time(job.created_at),
        "updated_at": iso_time(job.updated_at),
    }
    if isinstance(meta, dict):
        doc["owner"] = meta.get("owner")  # which process runs it (see the module docstring)
        if meta.get("conversion_id") is not None:
            doc["conversion_id"] = meta["conversion_id"]
    return doc


def get_job(s: Session, job_id: int) -> dict[str, Any]:
    job = s.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"no job {job_id}")
    return job_dict(job)


def list_jobs(s: Session, limit: int = 100) -> list[dict[str, Any]]:
    return [job_dict(j) for j in s.execute(select(Job).order_by(Job.id.desc()).limit(limit)).scalars()]


def select_shards(s: Session, run_name: str, step: int | None) -> tuple[Run, list[tuple[int, str, int, str | None]]]:
    """(id, path, checkpoint id, node) of the run's (or step's) live shard rows."""
    run = get_run(s, run_name)
    q = select(Shard.id, Shard.path, Shard.checkpoint_id, Shard.node).join(Checkpoint, Shard.checkpoint_id == Checkpoint.id).where(
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
    shards: list[tuple[int, str, int, str | None]],
    progress: Callable[[int, int], None] = lambda done, total: None,
    *,
    owner: Callable[[], repo.Owner] = lambda: repo.LOCAL,
) -> dict[str, Any]:
    """Re-examine and re-verify the shards this node may judge, then re-run the step checks.
    Returns a summary; shards held by other nodes are counted per node in ``other_nodes`` (each
    node re-verifies its own: this one cannot see a node-local disk of another)."""
    states: dict[str, int] = {}
    held: dict[str, int] = {}
    for start in range(0, len(shards), _CHUNK):
        chunk = shards[start : start + _CHUNK]
        me = owner()
        # files of unowned rows or unreachable nodes that this node sees become its own here
        examine_many([path for _, path, _, node in chunk if me.may_take(node)])  # replaced/vanished files first
        with sessions() as s:
            now_held = dict(s.execute(select(Shard.id, Shard.node).where(
                Shard.id.in_([shard_id for shard_id, _, _, _ in chunk]))).all())
        mine = [shard_id for shard_id, _, _, _ in chunk if shard_id in now_held and me.may_judge_gone(now_held[shard_id])]
        for shard_id in now_held.keys() - set(mine):
            name = now_held[shard_id] or "unclaimed"  # a pre-0006 row no node has seen yet
            held[name] = held.get(name, 0) + 1
        verdicts = verify_shards(mine)
        for shard_id in mine:
            state = verdicts.get(shard_id)
            key = state.value if state is not None else "skipped"
            states[key] = states.get(key, 0) + 1
        progress(start + len(chunk), len(shards))
    step_problems = {}
    for ckpt_id in sorted({c for _, _, c, _ in shards}):
        with sessions.begin() as s:
            ckpt = s.get(Checkpoint, ckpt_id)
            if ckpt is None:
                continue
            ckpt.step_checks_ok, step = None, ckpt.step
        problems = check_step(ckpt_id)
        if problems:
            step_problems[str(step)] = problems
    return {"shards": states, "other_nodes": held, "step_problems": step_problems}


# --- owners, heartbeats, abandoned work ----------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a pid on this machine, or None."""
    raw = _read_text(f"/proc/{int(pid)}/stat")
    if raw is None or ")" not in raw:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 on; comm may hold spaces
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


@functools.cache
def this_machine() -> dict[str, str | None]:
    """Host, boot id and PID namespace: what makes a recorded pid meaningful here."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "boot": _read_text("/proc/sys/kernel/random/boot_id"), "pidns": pidns}


def process_owner(node: str | None = None) -> dict[str, Any]:
    """This process, as recorded on the jobs it runs (JSON-able)."""
    m = this_machine()
    stat = _proc_stat(os.getpid())
    return {"node": node or os.environ.get("CKPTD_NODE_NAME") or m["host"], "host": m["host"], "pid": os.getpid(),
            "start": stat[1] if stat else None, "boot": m["boot"], "pidns": m["pidns"]}


def same_pid_space(owner: dict[str, Any]) -> bool:
    """True if ``owner``'s pid can be looked up here: this boot of this machine, this PID namespace."""
    m = this_machine()
    return bool(m["boot"] and m["pidns"]) and owner.get("boot") == m["boot"] and owner.get("pidns") == m["pidns"]


def _describe(owner: dict[str, Any]) -> str:
    return f"its process (pid {owner.get('pid')} on {owner.get('node') or owner.get('host')})"


def owner_gone(owner: dict[str, Any] | None, updated_at: datetime | None, now: datetime,
               timeout: float = ABANDON_TIMEOUT) -> str | None:
    """Why the process that owns a queued/running row is certainly gone; None while it may be alive."""
    age = (now - as_utc(updated_at)).total_seconds() if updated_at is not None else float("inf")
    if not owner:
        if age > LEGACY_ABANDON_AFTER.total_seconds():
            return f"no process recorded on it and no update for {age:.0f} s"
        return None
    who = _describe(owner)
    if same_pid_space(owner):
        stat = _proc_stat(int(owner.get("pid") or 0))
        if stat is None:
            return f"{who} is not running"
        state, start = stat
        if state in ("Z", "X"):
            return f"{who} has exited"
        if owner.get("start") is not None and start != owner["start"]:
            return f"{who} is not running (the pid belongs to a newer process)"
        return None
    if age > timeout:
        return f"{who} renewed nothing for {age:.0f} s (limit {timeout:g} s)"
    return None


def job_meta(job: Job) -> dict[str, Any]:
    try:
        params = json.loads(job.params) if job.params else None
    except ValueError:
        return {}
    meta = params.get(_META) if isinstance(params, dict) else None
    return meta if isinstance(meta, dict) else {}


def _params_with(params: dict[str, Any], **meta: Any) -> str:
    out = dict(params)
    out[_META] = {**(out.get(_META) or {}), **meta}
    return json.dumps(out, default=str)


def record_job(s: Session, kind: str, run_id: int | None, params: dict[str, Any], owner: dict[str, Any], *,
               state: str = "queued", total: int = 0) -> Job:
    """A new job row owned by ``owner`` (flushed: its id is set)."""
    job = Job(kind=kind, run_id=run_id, state=state, total=total, done=0, params=_params_with(params, owner=owner))
    s.add(job)
    s.flush()
    return job


def link_conversion(s: Session, job_id: int, conversion_id: int) -> None:
    """Tie a conversion row to the job running it (in the transaction that creates the row)."""
    job = s.get(Job, job_id)
    if job is not None:
        params = json.loads(job.params) if job.params else {}
        job.params = _params_with(params if isinstance(params, dict) else {}, conversion_id=conversion_id)


def conversion_links(s: Session) -> dict[int, Job]:
    """conversion id -> the job that runs (or ran) it."""
    out: dict[int, Job] = {}
    for job in s.execute(select(Job).where(Job.kind == "convert")).scalars():
        cid = job_meta(job).get("conversion_id")
        if isinstance(cid, int):
            out[cid] = job
    return out


_current_job: contextvars.ContextVar[int | None] = contextvars.ContextVar("ckptd_current_job", default=None)


def current_job() -> int | None:
    """The id of the job whose work is running on this thread (JobRunner), or None."""
    return _current_job.get()


class Heartbeat:
    """Renews ``updated_at`` of the jobs it holds, while they are queued or running, every
    ``interval`` seconds from its own thread (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session], interval: float = HEARTBEAT_INTERVAL) -> None:
        self.sessions, self.interval = sessions, interval
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, job_id: int) -> None:
        with self._lock:
            self._ids.add(job_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ckptd-job-heartbeat", daemon=True)
                self._thread.start()

    def discard(self, job_id: int) -> None:
        with self._lock:
            self._ids.discard(job_id)

    def beat(self) -> None:
        with self._lock:
            ids = sorted(self._ids)
        if ids:
            with self.sessions.begin() as s:
                s.execute(update(Job).where(Job.id.in_(ids), Job.state.in_(ACTIVE))
                          .values(updated_at=datetime.now(timezone.utc)))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception:  # the catalog is briefly unreachable: the next beat retries
                log.warning("could not renew the heartbeat of jobs %s", sorted(self._ids), exc_info=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.interval))

    def __enter__(self) -> "Heartbeat":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def recover_abandoned(sessions: sessionmaker[Session], root: str, *, timeout: float = ABANDON_TIMEOUT,
                      now: datetime | None = None, at_start: bool = True) -> dict[str, Any]:
    """Fail the queued/running jobs and conversions whose process is gone (:func:`owner_gone`),
    release what their conversions held (the source's lease, see
    :func:`ckptd.service.conversions.recover_conversions`) and remove their temp data inside
    ``root``. Work of live processes — this one, another daemon, ``ckptd convert`` — is left alone.
    Idempotent and cheap (one query per table when nothing runs): call it at daemon start, and
    periodically with ``at_start=False`` (a process elsewhere counts as gone only ``timeout``
    after its last heartbeat, so a start alone never sees it). ``at_start`` also looks for temp
    trees this machine holds of conversions another daemon failed while it was down. Returns::

        {"jobs": [{"id", "kind", "why"}], "conversions": [{"id", "why"}], "removed": [paths],
         "refused": [why], "left": [why]}
    """
    now = now or datetime.now(timezone.utc)
    report: dict[str, Any] = {"jobs": [], "conversions": [], "removed": [], "refused": [], "left": []}
    with sessions.begin() as s:
        q = select(Job).where(Job.state.in_(ACTIVE)).order_by(Job.id)
        for job in s.execute(repo.for_update(q, s)).scalars().all():
            why = owner_gone(job_meta(job).get("owner"), job.updated_at, now, timeout)
            if why is not None:
                job.state, job.error = "failed", f"abandoned: {why}"
                report["jobs"].append({"id": job.id, "kind": job.kind, "why": why})
    for j in report["jobs"]:
        log.warning("job %s (%s) failed as abandoned: %s", j["id"], j["kind"], j["why"])
    from ckptd.service.conversions import recover_conversions

    recover_conversions(sessions, root, report, now=now, sweep_earlier=at_start)
    return report


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
        self._queue: collections.deque[tuple[int, Callable[[Callable[[int, int], None]], dict[str, Any]]]] = \
            collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._running: int | None = None  # the job on the thread, and when it last made progress
        self._progress_at = 0.0

    def start_verify(self, run_name: str, step: int | None) -> dict[str, Any]:
        with self.sessions() as s:
            _, shards = select_shards(s, run_name, step)

        def work(progress: Callable[[int, int], None]) -> dict[str, Any]:
            return reverify(self.sessions, self._examine, self._verify, self._check_step, shards, progress,
                            owner=self._nodes)

        return self.start("verify", run_name, {"run": run_name, "step": step}, len(shards), work)

    def start(self, kind: str, run_name: str, params: dict[str, Any], total: int,
              work: Callable[[Callable[[int, int], None]], dict[str, Any]]) -> dict[str, Any]:
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
            s.execute(update(Job).where(Job.id == job_id, Job.state.in_(ACTIVE)).values(state=state, **values))

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
        self._set(job_id, done=done, total=total)

    def _run(self, job_id: int, work: Callable[[Callable[[int, int], None]], dict[str, Any]]) -> None:
        token = _current_job.set(job_id)
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
            _current_job.reset(token)
            self._heartbeat.discard(job_id)

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
            self._record_end(running, "interrupted by shutdown: ckptd stopped while the job ran")
        self._heartbeat.close()

    def _record_end(self, job_id: int, why: str) -> None:
        try:
            self._end(job_id, error=why)
        except Exception:
            log.warning("could not record job %s as ended (the next start fails it)", job_id, exc_info=True)


_CANCELLED = "cancelled: ckptd stopped before the job ran"
