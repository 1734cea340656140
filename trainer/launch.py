"""Launcher: run the trainer under ``msrun``, supervise every rank, resume automatically after a failure.

``python -m trainer.launch --run-dir D --tp 2 --dp 2 [--ckptd-url URL | --resume-cmd CMD] -- [train args]``

Per attempt: ask the resume oracle (ckptd over HTTP -- after giving ckptd up to ``--settle-timeout``
to judge the newest save committed on disk, so a restart is not told an older step only because the
daemon is still verifying the last one -- or a command printing the same JSON), start
``msrun`` with ``--resume-from`` when there is something to resume, then watch each rank's heartbeat
file (pid, step, phase, time) and exit marker. A rank fails when its process is gone without a clean
exit marker, when it writes a non-zero exit marker, or when its heartbeat goes stale (a hung rank --
ranks blocked in a collective behind it go stale too, so the culprit is the one furthest behind).
On failure: kill the whole job (msrun, its scheduler and every worker, which msrun puts in their own
sessions), back off, ask the oracle again and restart -- at most ``--max-restarts`` times. When
the step to resume was saved in another layout (another world size after a lost node, or another
tp/dp split of the same world), the job resumes from ckptd's re-sharded copy (see trainer.elastic). Every
decision is one ``launch:`` log line on stderr and in ``<run-dir>/launcher.log``.

ckptd briefly down (restarting, overloaded) is not a reason to kill the job: when the oracle cannot be
asked -- no connection, a timeout, HTTP 5xx/429/408, or a ckptd just (re)started that has not
finished its first rescan of the root (``/healthz``) -- the launcher asks again with exponential
back-off (``--oracle-backoff`` doubling up to ``--oracle-backoff-max``) for up to ``--oracle-wait``
seconds, one ``event=oracle-wait`` line per wait, and only then gives up (exit 2) -- or, with
``--oracle-fallback scan``, resumes from its own scan of the run directory (trainer.scan_resume: the
newest save whose every shard matches its ``.done`` sidecar, in exactly this job's layout). A definite
answer (a step, 404 ``no_restorable_step`` / ``not_found``) is acted on at once; an answer that is
not one (malformed JSON, a refused token, another 4xx) stops the launcher at once.

``--layout mindformers`` makes the trainer write MindFormers 2.1.0's legacy layout into ``--run-dir``
(see trainer.train); nothing else changes: the oracle's answer names every rank's shard, and each
restart into the directory writes the next incarnation's ``{P}_rank_<r>_<k>-{E}_{S}.ckpt`` files.

msrun quirk: after all workers exit cleanly, MindSpore's CPU scheduler still waits ~30 s for
heartbeats and then reports the workers "timed out" (msrun exits 1). The launcher therefore decides
success from the ranks' exit markers and then stops msrun itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from trainer.elastic import in_other_layout, job_strategy_hash, resume_converted
from trainer.health import exit_path, heartbeat_path
from trainer.oracle import (
    ConversionError,
    OracleError,
    OracleUnavailable,
    ResumeAnswer,
    ask_command,
    ask_http,
    ask_local_scan,
    check_ready,
    wait_for_verdicts,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(REPO_ROOT, "trainer", "train.py")
#: how far into a step a heartbeat phase is: of several stale ranks, the one furthest behind is the
#: culprit (ranks blocked in a collective behind a hung peer have reported a later phase or step)
_PHASE_ORDER = {"starting": 0, "train": 1, "compute": 2, "sync": 3, "save": 4, "finishing": 5}
_WORKER_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainer.launch", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--run-name", default=None, help="ckptd run name (default: basename of --run-dir)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--layout", choices=("native", "mindformers"), default="native",
                   help="the trainer's on-disk layout (passed through as trainer.train --layout); mindformers: "
                        "--run-dir is MindFormers' output_dir, and every restart into it writes the next "
                        "{P}_rank_<r>_<k> files, as MindFormers does")
    p.add_argument("--ckptd-url", default=os.environ.get("CKPTD_URL"), help="resume oracle + health reports")
    p.add_argument("--resume-cmd", default=None, help="shell command printing a resume answer (instead of HTTP)")
    p.add_argument("--fresh", action="store_true", help="do not ask the oracle before the first attempt")
    p.add_argument("--settle-timeout", type=float, default=60.0,
                   help="before asking ckptd, wait up to this long for its verdict on the newest save on disk")
    p.add_argument("--oracle-wait", type=float, default=120.0,
                   help="ckptd unreachable (or 5xx/timeout): keep asking, with back-off, for up to this many seconds "
                        "before giving up or falling back (0: do not retry)")
    p.add_argument("--oracle-backoff", type=float, default=0.5, help="first wait when ckptd is unreachable (s); doubles")
    p.add_argument("--oracle-backoff-max", type=float, default=10.0, help="longest single wait for ckptd (s)")
    p.add_argument("--oracle-fallback", choices=("none", "scan"), default="none",
                   help="when ckptd stays unreachable past --oracle-wait: none = give up (exit 2); scan = resume "
                        "from the launcher's own scan of --run-dir (trainer.scan_resume)")
    p.add_argument("--convert-timeout", type=float, default=300.0,
                   help="elastic restart: wait at most this long for ckptd to re-shard a checkpoint for this layout")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--backoff", type=float, default=1.0, help="first restart delay (s); doubles each restart")
    p.add_argument("--backoff-max", type=float, default=30.0)
    p.add_argument("--heartbeat-timeout", type=float, default=60.0, help="a training rank silent this long is hung")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="allowance for import + cluster init")
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("--fault", action="append", default=[], help="KIND:RANK:STEP, injected in the first attempt")
    p.add_argument("--msrun", default=None, help="msrun executable (default: next to this python)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then extra trainer.train arguments")
    return p


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
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


class Job:
    """One msrun attempt."""

    def __init__(self, args, attempt: int, hb_dir: str, resume_file: str | None, log: Log) -> None:
        self.args, self.attempt, self.hb_dir, self.log = args, attempt, hb_dir, log
        self.world = args.tp * args.dp
        self.log_dir = os.path.join(args.run_dir, "launcher", f"attempt_{attempt}")
        os.makedirs(self.log_dir, exist_ok=True)
        for r in range(self.world):
            for p in (heartbeat_path(hb_dir, r), exit_path(hb_dir, r)):
                if os.path.exists(p):
                    os.unlink(p)
        msrun = args.msrun or os.path.join(os.path.dirname(sys.executable), "msrun")
        train = ["--run-dir", args.run_dir, "--tp", str(args.tp), "--dp", str(args.dp), "--attempt", str(attempt),
                 "--heartbeat-dir", hb_dir, "--run-name", args.run_name, "--layout", args.layout]
        if args.ckptd_url:
            train += ["--ckptd-url", args.ckptd_url]
        if resume_file:
            train += ["--resume-from", resume_file]
        for f in args.fault:
            train += ["--fault", f]
        extra = [a for a in args.train_args if a != "--"]
        cmd = [msrun, "--worker_num", str(self.world), "--local_worker_num", str(self.world),
               "--master_port", str(_free_port()), "--log_dir", self.log_dir, "--join", "True",
               TRAIN_PY, *train, *extra]
        env = dict(os.environ)
        # msrun starts workers as plain "python": make it this interpreter, and make trainer/ckptd importable
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("GLOG_v", "3")
        env.setdefault("OMP_NUM_THREADS", "1")
        self.out_path = os.path.join(self.log_dir, "msrun.out")
        self.out = open(self.out_path, "wb")  # noqa: SIM115 -- msrun writes it for the whole attempt
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started = time.time()

    def _msrun_exit_codes(self) -> dict[int, int]:
        try:
            with open(self.out_path, errors="replace") as fh:
                return {int(pid): int(code) for pid, code in _WORKER_EXIT.findall(fh.read())}
        except OSError:
            return {}

    def check(self) -> tuple[str, Failure | None]:
        """("running" | "done" | "failed", failure)."""
        now = time.time()
        beats = {r: _read_json(heartbeat_path(self.hb_dir, r)) for r in range(self.world)}
        exits = {r: _read_json(exit_path(self.hb_dir, r)) for r in range(self.world)}
        if all(e is not None and e.get("code") == 0 for e in exits.values()):
            return "done", None
        for r, e in exits.items():
            if e is not None and e.get("code") != 0:
                return "failed", Failure(r, e.get("step"), f"exit marker code {e.get('code')}")
        dead = []
        for r, hb in beats.items():
            if hb is not None and exits[r] is None and not _alive(int(hb["pid"])):
                dead.append((r, hb))
        if dead:
            time.sleep(1.5)  # let msrun log the exit code of the first worker it reaped
            codes = self._msrun_exit_codes()
            first = next(((r, hb) for r, hb in dead if int(hb["pid"]) in codes), None)
            r, hb = first or min(dead, key=lambda x: (x[1].get("step", 0), x[0]))
            code = codes.get(int(hb["pid"]))
            why = _signal_name(code) if code is not None else "process vanished"
            return "failed", Failure(r, hb.get("step"), f"rank process died ({why}) in phase {hb.get('phase')}")
        stale = []
        for r, hb in beats.items():
            if exits[r] is not None:
                continue
            if hb is None:
                if now - self.started > self.args.startup_timeout:
                    return "failed", Failure(r, None, f"no heartbeat within {self.args.startup_timeout:.0f}s of start")
                continue
            limit = self.args.startup_timeout if hb.get("phase") == "starting" else self.args.heartbeat_timeout
            if now - float(hb["time"]) > limit:
                stale.append((r, hb))
        if stale:
            r, hb = min(stale, key=lambda x: (x[1].get("step", 0), _PHASE_ORDER.get(x[1].get("phase"), 9), x[1]["time"]))
            return "failed", Failure(r, hb.get("step"), f"heartbeat stale for {now - float(hb['time']):.0f}s "
                                                        f"(hung in phase {hb.get('phase')})")
        rc = self.proc.poll()
        if rc is not None:
            return "failed", Failure(None, None, f"msrun exited with code {rc} before all ranks finished")
        return "running", None

    def stop(self) -> None:
        """SIGKILL msrun, its scheduler and every worker (each worker leads its own session)."""
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


def ask_oracle(args, world: int, attempt: int, log: Log) -> ResumeAnswer:
    if args.resume_cmd:
        answer = ask_command(args.resume_cmd, world)
        if answer.saved_world is not None:  # only ckptd converts: give up rather than start fresh
            raise ConversionError(f"step {answer.step} was saved with world size {answer.saved_world}, the job has "
                                  f"{world}, and only ckptd can convert it")
        return answer
    if args.ckptd_url:
        return ask_ckptd_patiently(args, world, attempt, log)
    return ResumeAnswer(None, None, "no oracle configured")


def ask_ckptd(args, world: int, attempt: int, log: Log, timeout: float = 10.0) -> ResumeAnswer:
    """One round with ckptd: ready (first rescan done), settle, ask, and (another layout) get a
    re-sharded copy."""
    check_ready(args.ckptd_url, timeout=min(5.0, timeout))
    if args.settle_timeout > 0:
        settle(args, world, attempt, log)
    # naming the job's world size: ckptd then says where a copy re-sharded for it is, if it has one
    answer = ask_http(args.ckptd_url, args.run_name, world, timeout=timeout, world_size=world)
    target = job_layout_hash(args)
    if in_other_layout(answer, target):
        return resume_converted(args.ckptd_url, args.run_name, args.tp, args.dp, target, answer,
                                args.convert_timeout, lambda **f: log(attempt=attempt, **f))
    return answer


def ask_ckptd_patiently(args, world: int, attempt: int, log: Log) -> ResumeAnswer:
    """ask_ckptd, again and again while ckptd cannot be asked (OracleUnavailable), with exponential
    back-off, for up to ``--oracle-wait`` s; then OracleError -- or the local scan when
    ``--oracle-fallback scan`` (never after a conversion was involved: only ckptd re-shards)."""
    t0 = time.monotonic()
    tries = 0
    while True:
        left = args.oracle_wait - (time.monotonic() - t0)
        try:
            answer = ask_ckptd(args, world, attempt, log, timeout=max(1.0, min(10.0, left)))
        except OracleUnavailable as err:
            tries += 1
            waited = time.monotonic() - t0
            left = args.oracle_wait - waited
            if left <= 0:
                why = (f"{err} (asked {tries} time{'s' if tries > 1 else ''} in {waited:.1f}s, "
                       f"--oracle-wait {args.oracle_wait:g}s)")
                if isinstance(err, ConversionError):
                    raise ConversionError(why) from None
                if args.oracle_fallback == "scan":
                    return fall_back_to_scan(args, attempt, log, why)
                raise OracleError(why) from None
            delay = min(args.oracle_backoff_max, args.oracle_backoff * (2 ** (tries - 1)), left)
            log(attempt=attempt, event="oracle-wait", tries=tries, waited=f"{waited:.1f}s", next=f"{delay:.2f}s",
                deadline=f"{args.oracle_wait:g}s", reason=str(err))
            time.sleep(delay)
            continue
        if tries:
            log(attempt=attempt, event="oracle_reached", tries=tries + 1,
                waited=f"{time.monotonic() - t0:.1f}s", reason="ckptd answered")
        return answer


def fall_back_to_scan(args, attempt: int, log: Log, why: str) -> ResumeAnswer:
    log(attempt=attempt, event="oracle-fallback", using="scan", reason=f"ckptd stayed unreachable: {why}")
    return ask_local_scan(args.run_dir, args.tp, args.dp)


def job_layout_hash(args) -> str:
    """This job's strategy hash (what a checkpoint must have been saved with to be loaded as it is)."""
    if getattr(args, "layout_hash", None) is None:
        try:
            args.layout_hash = job_strategy_hash(args.tp, args.dp, args.train_args)
        except ValueError as err:
            raise OracleError(f"this job's layout tp={args.tp},dp={args.dp} does not fit the model: {err}") from None
    return args.layout_hash


def settle(args, world: int, attempt: int, log: Log) -> None:
    """Give ckptd time to judge the save the job finished just before it died (see wait_for_verdicts)."""
    res = wait_for_verdicts(args.ckptd_url, args.run_name, args.run_dir, world, args.settle_timeout,
                            raise_unavailable=True)
    if not res.states:
        return  # nothing committed on disk: nothing to wait for
    seen = ", ".join(f"{step}={state}" for (_, step), state in res.states.items())
    if res.settled:
        log(attempt=attempt, event="catalog_settled", waited=f"{res.waited:.1f}s", steps=seen,
            reason="ckptd has judged the newest committed save")
    else:
        log(attempt=attempt, event="catalog_lagging", waited=f"{res.waited:.1f}s", steps=seen,
            reason="ckptd has not judged the newest committed save in time; asking anyway")


def run(args) -> int:
    args.run_dir = os.path.abspath(args.run_dir)
    args.run_name = args.run_name or os.path.basename(args.run_dir)
    os.makedirs(args.run_dir, exist_ok=True)
    hb_dir = os.path.join(args.run_dir, "heartbeat")
    log = Log(os.path.join(args.run_dir, "launcher.log"))
    world = args.tp * args.dp
    for attempt in range(args.max_restarts + 1):
        resume_file = None
        if attempt > 0 or not args.fresh:
            try:
                answer = ask_oracle(args, world, attempt, log)
            except ConversionError as err:
                log(attempt=attempt, event="convert_failed", to_world=world,
                    reason=f"giving up (no fresh start over a checkpoint in another layout): {err}")
                return 2
            except OracleError as err:
                log(attempt=attempt, event="oracle_error", reason=str(err))
                return 2
            if answer.step is not None:
                resume_file = os.path.join(args.run_dir, "launcher", f"resume_{attempt}.json")
                os.makedirs(os.path.dirname(resume_file), exist_ok=True)
                with open(resume_file, "w") as fh:
                    json.dump(answer.body, fh)
            if answer.saved_world is not None:  # a converted copy: say both world sizes
                log(attempt=attempt, event="resume", step=answer.step, from_world=answer.saved_world,
                    to_world=world, reason=answer.why)
            else:
                log(attempt=attempt, event="resume" if answer.step is not None else "fresh_start",
                    step=answer.step if answer.step is not None else 0, reason=answer.why)
        job = Job(args, attempt, hb_dir, resume_file, log)
        log(attempt=attempt, event="started", world=world, tp=args.tp, dp=args.dp, msrun_pid=job.proc.pid,
            logs=job.log_dir)
        try:
            while True:
                time.sleep(args.poll)
                state, failure = job.check()
                if state != "running":
                    break
        except BaseException as exc:  # Ctrl-C / SIGTERM: never leave ranks running (they are in their own sessions)
            job.stop()
            log(attempt=attempt, event="interrupted", reason=f"{type(exc).__name__}: stopped all ranks")
            raise
        if state == "done":
            job.stop()
            log(attempt=attempt, event="finished", reason="every rank wrote a clean exit marker")
            return 0
        job.stop()
        log(attempt=attempt, event="rank_failed", rank=failure.rank if failure.rank is not None else "?",
            step=failure.step if failure.step is not None else "?", reason=failure.reason)
        if attempt == args.max_restarts:
            log(attempt=attempt, event="giving_up", reason=f"{args.max_restarts} restarts used")
            return 1
        delay = min(args.backoff_max, args.backoff * (2 ** attempt))
        log(attempt=attempt, event="backoff", seconds=f"{delay:.2f}", reason="stopped all ranks; restarting")
        time.sleep(delay)
    return 1


def main(argv: list[str] | None = None) -> int:
    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
