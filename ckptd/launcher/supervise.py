"""Supervising a job: one attempt (:class:`Job`), and the restart loop (:func:`supervise`).

A job is any command -- typically ``msrun --worker_num=N --local_worker_num=N ... script.py`` -- whose
ranks write heartbeat files (pid, step, phase, time) and an exit marker into the directory named by
``CKPTD_HEARTBEAT_DIR`` (:mod:`ckptd.launcher.heartbeat`: ckptd's trainer and the MindSpore callback
both do). A rank fails when its process is gone without a clean exit marker, when it writes a
non-zero exit marker, or when its heartbeat goes stale (a hung rank -- ranks blocked in a collective
behind it go stale too, so the culprit is the one furthest behind). On failure the whole job is
killed (the command, msrun's scheduler and every worker, which msrun puts in their own sessions),
the loop backs off, asks the oracle again and restarts -- at most ``max_restarts`` times. Every
decision is one ``launch:`` line on stderr and in ``<run-dir>/launcher.log``.

msrun quirk: after all workers exit cleanly, MindSpore's CPU scheduler still waits ~30 s for
heartbeats and then reports the workers "timed out" (msrun exits 1). Success is therefore decided
from the ranks' exit markers (and their processes being gone), and then msrun is stopped.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ckptd import procs
from ckptd.errors import CkptdError
from ckptd.launcher.objfetch import fetch_answer
from ckptd.launcher.freshstart import FreshStart
from ckptd.launcher.heartbeat import exit_path, heartbeat_path
from ckptd.launcher.oracle import (
    ConversionError,
    OracleError,
    OracleUnavailable,
    ResumeAnswer,
    ask_http,
    check_ready,
    wait_settled,
)
from ckptd.split import ParallelSplit

#: variables a previous launcher (or the user's shell) may have left: an attempt sees only its own
JOB_ENV = ("CKPTD_HEARTBEAT_DIR", "CKPTD_ATTEMPT", "CKPTD_RUN_NAME", "CKPTD_RESUME_FILE", "CKPTD_RESUME_BY")

#: how long to wait for msrun to log the exit code of a worker found dead
REAP_WAIT = 5.0
#: how far into a step a heartbeat phase is: the rank furthest behind is the culprit (ranks
#: blocked in a collective behind a hung peer have reported a later phase or step)
PHASE_ORDER = {"starting": 0, "train": 1, "compute": 2, "sync": 3, "save": 4, "finishing": 5}
_WORKER_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
T = TypeVar("T")


class Log:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, **fields: object) -> None:
        parts = []
        for k, v in fields.items():
            s = str(v)
            parts.append(f"{k}={json.dumps(s, ensure_ascii=False) if (' ' in s or not s) else s}")
        line = "launch: " + " ".join(parts)
        print(line, file=sys.stderr, flush=True)
        with open(self.path, "a") as fh:
            fh.write(f"{time.time():.3f} {line}\n")


@dataclass
class Failure:
    rank: int | None
    step: int | None
    reason: str


@dataclass(frozen=True)
class Watch:
    """How ranks are judged: silent this long = hung; allowance before the first step."""
    heartbeat_timeout: float = 60.0
    startup_timeout: float = 180.0
    #: all ranks wrote a clean exit marker: give their processes this long to exit by themselves
    exit_grace: float = 10.0


#: how many ports below the kernel's ephemeral range :func:`free_port` draws from
_POOL = 12_000


def free_port() -> int:
    """A TCP port free now, for a listener started later (msrun's scheduler, a server).

    Drawn at random *below* the kernel's ephemeral range, not by ``bind(0)``: the listener binds it
    seconds later, and a port of the ephemeral range is what the kernel hands to every ``bind(0)``
    and outgoing connection on the host meanwhile (another job's chosen port, this host's HTTP
    clients). msrun's workers then spoke RPC to someone's HTTP server and the job never started."""
    top = _first_ephemeral_port()
    rng = random.SystemRandom()
    for _ in range(64):
        with socket.socket() as s:
            try:  # every address: msrun's scheduler may listen on more than loopback
                s.bind(("", rng.randrange(max(1024, top - _POOL), top) if top > 2048 else 0))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port below the ephemeral range after 64 tries")


def _first_ephemeral_port() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _descendants(root: int) -> list[int]:
    children = procs.children()
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def least_advanced(beats: dict[int, dict]) -> int:
    """The rank whose last heartbeat is furthest behind: lowest step, then earliest phase, then oldest."""
    return min(beats, key=lambda r: (beats[r].get("step", 0), PHASE_ORDER.get(beats[r].get("phase"), 9),
                                     float(beats[r]["time"]), r))


class Job:
    """One attempt: ``cmd`` started in its own session, its output in ``<log_dir>/msrun.out``."""

    def __init__(self, cmd: list[str], env: dict[str, str], world: int, hb_dir: str, log_dir: str,
                 watch: Watch) -> None:
        self.world, self.hb_dir, self.log_dir, self.watch = world, hb_dir, log_dir, watch
        os.makedirs(log_dir, exist_ok=True)
        os.makedirs(hb_dir, exist_ok=True)
        for r in range(world):  # the previous attempt's files would pass for this one's
            for p in (heartbeat_path(hb_dir, r), exit_path(hb_dir, r)):
                if os.path.exists(p):
                    os.unlink(p)
        self.out_path = os.path.join(log_dir, "msrun.out")
        self.out = open(self.out_path, "wb")  # noqa: SIM115 -- the job writes it for the whole attempt
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started = time.time()
        #: every rank wrote its clean exit marker, some process still works (after training)
        self.finishing: float | None = None
        #: every rank wrote its clean exit marker and its process is gone: msrun's grace runs
        self.all_exited: float | None = None

    def _msrun_exit_codes(self) -> dict[int, int]:
        try:
            with open(self.out_path, errors="replace") as fh:
                return {int(pid): int(code) for pid, code in _WORKER_EXIT.findall(fh.read())}
        except OSError:
            return {}

    def _reaped_codes(self, pids: list[int]) -> dict[int, int]:
        """msrun's exit codes, once it has logged one of ``pids`` (it polls its workers about once a
        second, later on a loaded machine) or exited, or after ``REAP_WAIT`` s: which rank died first,
        and of what, is in its log, not in the heartbeat files."""
        deadline = time.monotonic() + REAP_WAIT
        while True:
            codes = self._msrun_exit_codes()
            if any(p in codes for p in pids) or self.proc.poll() is not None or time.monotonic() >= deadline:
                return codes
            time.sleep(0.1)

    def check(self) -> tuple[str, Failure | None]:
        """("running" | "done" | "failed", failure)."""
        now = time.time()
        beats = {r: _read_json(heartbeat_path(self.hb_dir, r)) for r in range(self.world)}
        exits = {r: _read_json(exit_path(self.hb_dir, r)) for r in range(self.world)}
        for r, e in exits.items():
            if e is not None and e.get("code") != 0:
                return "failed", Failure(r, e.get("step"), f"exit marker code {e.get('code')}")
        if all(e is not None for e in exits.values()):
            # every rank is through training. What a script does after it (evaluate, export) is its
            # own work: its processes are waited for, however long, never killed; a rank that then
            # dies with an error is a failure (msrun names it). Only msrun itself is stopped, once
            # the workers are gone and it had exit_grace to exit (its CPU scheduler lingers ~30 s).
            codes = self._msrun_exit_codes()
            for r, hb in beats.items():
                code = codes.get(int(hb["pid"])) if hb else None
                if code:
                    return "failed", Failure(r, exits[r].get("step"), f"rank process exited with "
                                             f"{_signal_name(code)} after its clean exit marker")
            if any(hb is not None and procs.alive(int(hb["pid"])) for hb in beats.values()):
                first, self.finishing = self.finishing is None, self.finishing or now
                return ("finishing" if first else "running"), None
            self.all_exited = self.all_exited or now
            if self.proc.poll() is not None or now - self.all_exited >= self.watch.exit_grace:
                return "done", None
            return "running", None
        dead = []
        for r, hb in beats.items():
            if hb is not None and exits[r] is None and not procs.alive(int(hb["pid"])):
                dead.append((r, hb))
        if dead:
            codes = self._reaped_codes([int(hb["pid"]) for _, hb in dead])
            # a rank that wrote its clean exit marker and exited after the markers were read above
            dead = [(r, hb) for r, hb in dead if _read_json(exit_path(self.hb_dir, r)) is None]
        if dead:
            by_pid = {int(hb["pid"]): (r, hb) for r, hb in dead}
            first = next((by_pid[pid] for pid in codes if pid in by_pid), None)  # msrun's log order
            r, hb = first or min(dead, key=lambda x: (x[1].get("step", 0), x[0]))
            code = codes.get(int(hb["pid"]))
            why = _signal_name(code) if code is not None else "process vanished"
            return "failed", Failure(r, hb.get("step"), f"rank process died ({why}) in phase {hb.get('phase')}")
        stale, quiet = [], {}
        for r, hb in beats.items():
            if exits[r] is not None:
                continue
            if hb is None:
                if now - self.started > self.watch.startup_timeout:
                    return "failed", Failure(r, None, f"no heartbeat within {self.watch.startup_timeout:.0f}s of "
                                                      f"start (does the job write heartbeats into $CKPTD_HEARTBEAT_DIR?)")
                continue
            setting_up = hb.get("phase") == "starting" or hb.get("startup") is True
            limit = self.watch.startup_timeout if setting_up else self.watch.heartbeat_timeout
            silent_for = now - float(hb["time"])
            if silent_for > limit:
                stale.append((r, hb))
            if silent_for > limit / 2:
                quiet[r] = hb
        if stale:
            # A rank blocked in a collective goes silent behind the peer that really hung, and may go
            # stale first (it beat last before the peer's last beat); the culprit is the quiet rank
            # (silent half its timeout or more: stale or about to be) that got least far. A rank that
            # still beats is making progress and is not blamed.
            r, (silent, oldest) = least_advanced(quiet), min(stale, key=lambda x: float(x[1]["time"]))
            hb = quiet[r]
            return "failed", Failure(r, hb.get("step"), f"heartbeat stale for {now - float(oldest['time']):.0f}s "
                                                        f"on rank {silent}; rank {r} got least far "
                                                        f"(hung in phase {hb.get('phase')} of step {hb.get('step')})")
        rc = self.proc.poll()
        if rc is not None:
            return "failed", Failure(None, None, f"msrun exited with code {rc} before all ranks finished")
        return "running", None

    def stop(self) -> None:
        """SIGKILL the command, msrun's scheduler and every worker (each worker leads its own session)."""
        pids = _descendants(self.proc.pid)
        for r in range(self.world):
            hb = _read_json(heartbeat_path(self.hb_dir, r))
            if hb:
                pids.append(int(hb["pid"]))
        for pid in [self.proc.pid, *pids]:
            for kill in (lambda p: os.killpg(p, signal.SIGKILL), lambda p: os.kill(p, signal.SIGKILL)):
                try:
                    kill(pid)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait()
        self.out.close()


@dataclass(frozen=True)
class Restarts:
    max_restarts: int = 3
    backoff: float = 1.0  # first restart delay (s); doubles each restart
    backoff_max: float = 30.0
    poll: float = 0.2


def ask_patiently(once: Callable[[float], T], wait: float, backoff: float, backoff_max: float,
                  log: Log, attempt: int, fallback: Callable[[str], T] | None = None) -> T:
    """``once(timeout)`` again and again while ckptd cannot be asked (OracleUnavailable), with
    exponential back-off, for up to ``wait`` s; then OracleError -- or ``fallback(why)`` when given
    (never after a conversion was involved: only ckptd re-shards)."""
    t0 = time.monotonic()
    tries = 0
    while True:
        left = wait - (time.monotonic() - t0)
        try:
            answer = once(max(1.0, min(10.0, left)))
        except OracleUnavailable as err:
            tries += 1
            waited = time.monotonic() - t0
            left = wait - waited
            if left <= 0:
                why = f"{err} (asked {tries} time{'s' if tries > 1 else ''} in {waited:.1f}s, --oracle-wait {wait:g}s)"
                if isinstance(err, ConversionError):
                    raise ConversionError(why) from None
                if fallback is not None:
                    return fallback(why)
                raise OracleError(why) from None
            delay = min(backoff_max, backoff * (2 ** (tries - 1)), left)
            log(attempt=attempt, event="oracle-wait", tries=tries, waited=f"{waited:.1f}s", next=f"{delay:.2f}s",
                deadline=f"{wait:g}s", reason=str(err))
            time.sleep(delay)
            continue
        if tries:
            log(attempt=attempt, event="oracle_reached", tries=tries + 1,
                waited=f"{time.monotonic() - t0:.1f}s", reason="ckptd answered")
        return answer


def ask_ckptd_once(url: str, run: str, world: int, settle_timeout: float, timeout: float, log: Log,
                   attempt: int, exclude_unreachable: bool = False, split: ParallelSplit | None = None,
                   tiers: str | None = None) -> ResumeAnswer:
    """One round with ckptd: ready (first rescan done), settle, ask -- naming the job's world size
    (and its split, when declared), so ckptd says whether the step must be re-sharded for it and
    where a ready copy is, if it has one."""
    check_ready(url, timeout=min(5.0, timeout))
    if settle_timeout > 0:
        settle(url, run, settle_timeout, log, attempt)
    return ask_http(url, run, world, timeout=timeout, world_size=world, exclude_unreachable=exclude_unreachable,
                    split=split, tiers=tiers)


def settle(url: str, run: str, timeout: float, log: Log, attempt: int) -> None:
    """Give ckptd time to judge the save the job finished just before it died (see wait_settled)."""
    res = wait_settled(url, run, timeout)
    if res.settled and not res.steps:
        return  # nothing of the run anywhere: nothing to wait for
    seen = ", ".join(f"{label}={state}" for label, state in res.steps)
    if res.settled:
        log(attempt=attempt, event="catalog_settled", waited=f"{res.waited:.1f}s", steps=seen,
            reason="ckptd has judged the newest committed save")
    else:
        log(attempt=attempt, event="catalog_lagging", waited=f"{res.waited:.1f}s", steps=seen,
            reason=f"ckptd has not judged the newest committed save in time ({res.outstanding}); asking anyway")


def supervise(run_dir: str, world: int, log: Log, ask: Callable[[int], ResumeAnswer],
              start: Callable[[int, str | None, ResumeAnswer | None], tuple[Job, dict]], restarts: Restarts,
              fresh: bool = False, fresh_start: FreshStart = FreshStart()) -> int:
    """The restart loop. ``ask(attempt)`` is the oracle (raises ConversionError / OracleError to stop);
    ``start(attempt, resume_file, answer)`` starts an attempt -- ``resume_file`` is the answer as JSON
    in ``<run_dir>/launcher/resume_<attempt>.json`` -- and returns it with the fields of its
    ``started`` line; ``fresh_start`` says whether a start from step 0 would throw saves away.
    Returns 0 (every rank finished), 1 (restarts used up) or 2 (oracle said stop)."""
    for attempt in range(restarts.max_restarts + 1):
        resume_file, answer = None, None
        if attempt == 0 and fresh and (refused := fresh_start.refusal(run_dir, world, None)):
            log(attempt=attempt, event="fresh_start_refused", reason=refused)
            return 2
        if attempt > 0 or not fresh:
            try:
                answer = ask(attempt)
            except ConversionError as err:
                log(attempt=attempt, event="convert_failed", to_world=world,
                    reason=f"giving up (no fresh start over a checkpoint in another layout): {err}")
                return 2
            except OracleError as err:
                log(attempt=attempt, event="oracle_error", reason=str(err))
                return 2
            if refused := fresh_start.refusal(run_dir, world, answer):
                log(attempt=attempt, event="fresh_start_refused", reason=refused)
                return 2
            if answer.body is not None and answer.body.get("tier") == "object":
                try:  # the files are gone: bring them back before the job looks for them
                    fetch_answer(answer.body, run_dir, log, attempt)
                except CkptdError as err:
                    log(attempt=attempt, event="fetch_failed", reason=str(err))
                    return 2
            if answer.step is not None:
                resume_file = os.path.join(run_dir, "launcher", f"resume_{attempt}.json")
                os.makedirs(os.path.dirname(resume_file), exist_ok=True)
                with open(resume_file, "w") as fh:
                    json.dump(answer.body, fh)
            if answer.saved_world is not None:  # a converted copy: say both world sizes
                log(attempt=attempt, event="resume", step=answer.step, from_world=answer.saved_world,
                    to_world=world, reason=answer.why)
            else:
                log(attempt=attempt, event="resume" if answer.step is not None else "fresh_start",
                    step=answer.step if answer.step is not None else 0, reason=answer.why)
        job, fields = start(attempt, resume_file, answer if resume_file else None)
        log(attempt=attempt, event="started", **fields)
        try:
            while True:
                time.sleep(restarts.poll)
                state, failure = job.check()
                if state == "finishing":
                    log(attempt=attempt, event="finishing", reason="every rank wrote its clean exit marker; waiting "
                                                                   "for the rank processes to exit (work after "
                                                                   "training is never killed)")
                elif state != "running":
                    break
        except BaseException as exc:  # Ctrl-C / SIGTERM: never leave ranks running (they are in their own sessions)
            job.stop()
            log(attempt=attempt, event="interrupted", reason=f"{type(exc).__name__}: stopped all ranks")
            raise
        lingering = job.proc.poll() is None
        job.stop()
        if state == "done":
            log(attempt=attempt, event="finished", reason="every rank wrote a clean exit marker and exited" +
                ("; stopped msrun, still running --exit-grace after its workers" if lingering else ""))
            return 0
        assert failure is not None
        log(attempt=attempt, event="rank_failed", rank=failure.rank if failure.rank is not None else "?",
            step=failure.step if failure.step is not None else "?", reason=failure.reason)
        if attempt == restarts.max_restarts:
            log(attempt=attempt, event="giving_up", reason=f"{restarts.max_restarts} restarts used")
            return 1
        delay = min(restarts.backoff_max, restarts.backoff * (2 ** attempt))
        log(attempt=attempt, event="backoff", seconds=f"{delay:.2f}", reason="stopped all ranks; restarting")
        time.sleep(delay)
    return 1


def install_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the loop stops every rank before the launcher exits."""
    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
