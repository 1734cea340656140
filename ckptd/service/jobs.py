"""Background jobs with progress stored in the catalog (``jobs`` table): re-verification, conversions.

Call order: ``JobRunner(sessions, examine_many, verify_shards, check_step)``
(:mod:`ckptd.service.jobrunner`) → ``start_verify(...)`` returns the job immediately → poll
``get_job`` → ``close()``. The verification itself runs synchronously, a chunk of shards at a
time, on the runner's own thread (one job at a time: jobs must not starve live ingest); a job is
cancelled (``JobRunner.cancel``) at once while queued, at its next progress report while running.

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

import contextlib
import contextvars
import functools
import json
import logging
import os
import socket
import threading
from datetime import datetime, timedelta, timezone
from collections.abc import Iterator
from typing import Any, Callable

from sqlalchemy.orm import Session, sessionmaker

from ckptd import procs
from ckptd.catalog import jobrows, repo
from ckptd.catalog.models import Checkpoint, Job, Run, as_utc
from ckptd.service.catalog import NotFoundError, iso_time, get_run, get_step
from ckptd.storage import PosixStorage

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
    return [job_dict(j) for j in jobrows.recent_jobs(s, limit)]


def select_shards(s: Session, run_name: str, step: int | None) -> tuple[Run, list[tuple[int, str, int, str | None]]]:
    """(id, path, checkpoint id, node) of the run's (or step's) live shard rows."""
    run = get_run(s, run_name)
    return run, jobrows.live_shards(s, run.id, get_step(s, run, step).id if step is not None else None)


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
            now_held = jobrows.shard_nodes(s, [shard_id for shard_id, _, _, _ in chunk])
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
    stat = procs.stat(os.getpid())
    return {"node": node or os.environ.get("CKPTD_NODE_NAME") or m["host"], "host": m["host"], "pid": os.getpid(),
            "start": stat.start if stat else None, "boot": m["boot"], "pidns": m["pidns"]}


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
        why = procs.why_gone(int(owner.get("pid") or 0), owner.get("start"))
        return f"{who} {why}" if why is not None else None
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
    for job in jobrows.convert_jobs(s):
        cid = job_meta(job).get("conversion_id")
        if isinstance(cid, int):
            out[cid] = job
    return out


_current_job: contextvars.ContextVar[int | None] = contextvars.ContextVar("ckptd_current_job", default=None)


def current_job() -> int | None:
    """The id of the job whose work is running on this thread (JobRunner), or None."""
    return _current_job.get()


@contextlib.contextmanager
def running_job(job_id: int) -> Iterator[None]:
    """Mark ``job_id`` as the job whose work runs on this thread (:func:`current_job`)."""
    token = _current_job.set(job_id)
    try:
        yield
    finally:
        _current_job.reset(token)


def __getattr__(name: str) -> Any:
    # JobRunner lives in ckptd.service.jobrunner (it imports this module); the old name still works
    if name == "JobRunner":
        from ckptd.service.jobrunner import JobRunner

        return JobRunner
    raise AttributeError(name)


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
                jobrows.renew_jobs(s, ids, ACTIVE, datetime.now(timezone.utc))

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


def recover_abandoned(sessions: sessionmaker[Session], store: PosixStorage, *, timeout: float = ABANDON_TIMEOUT,
                      now: datetime | None = None, at_start: bool = True) -> dict[str, Any]:
    """Fail the queued/running jobs and conversions whose process is gone (:func:`owner_gone`),
    release what their conversions held (the source's lease, see
    :func:`ckptd.service.conversions.recover_conversions`) and remove their temp data inside
    the root. Work of live processes — this one, another daemon, ``ckptd convert`` — is left alone.
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
        for job in jobrows.lock_active_jobs(s, ACTIVE):
            why = owner_gone(job_meta(job).get("owner"), job.updated_at, now, timeout)
            if why is not None:
                job.state, job.error = "failed", f"abandoned: {why}"
                report["jobs"].append({"id": job.id, "kind": job.kind, "why": why})
    for j in report["jobs"]:
        log.warning("job %s (%s) failed as abandoned: %s", j["id"], j["kind"], j["why"])
    from ckptd.service.conversions import recover_conversions

    recover_conversions(sessions, store, report, now=now, sweep_earlier=at_start)
    return report
