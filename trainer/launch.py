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
import os
import sys

from ckptd.launcher import freshstart
from ckptd.launcher.freshstart import FreshStart
from ckptd.launcher.oracle import ConversionError, OracleError, ResumeAnswer, ask_command
from ckptd.launcher.supervise import (JOB_ENV, Job, Log, Restarts, Watch, ask_ckptd_once, ask_patiently, free_port,
                                      install_sigterm, supervise)
from trainer.elastic import in_other_layout, job_strategy_hash, resume_converted
from trainer.oracle import ask_local_scan

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(REPO_ROOT, "trainer", "train.py")


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
    p.add_argument("--fresh", action="store_true", help="do not ask the oracle before the first attempt (refused "
                                                       "when the run dir holds committed saves)")
    p.add_argument("--allow-fresh-start", action="store_true",
                   help="allow training from step 0 over saves the oracle cannot see (see ckptd launch)")
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


def start_job(args, attempt: int, hb_dir: str, resume_file: str | None) -> tuple[Job, dict]:
    """One msrun attempt of trainer/train.py (the generic :class:`ckptd.launcher.supervise.Job`)."""
    world = args.tp * args.dp
    log_dir = os.path.join(args.run_dir, "launcher", f"attempt_{attempt}")
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
    cmd = [msrun, "--worker_num", str(world), "--local_worker_num", str(world),
           "--master_port", str(free_port()), "--log_dir", log_dir, "--join", "True",
           TRAIN_PY, *train, *extra]
    env = {k: v for k, v in os.environ.items() if k not in JOB_ENV}  # an attempt sees only its own
    # msrun starts workers as plain "python": make it this interpreter, and make trainer/ckptd importable
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("GLOG_v", "3")
    env.setdefault("OMP_NUM_THREADS", "1")
    # the trainer's clean exit marker is its last act: nothing left to wait for (exit_grace 0)
    job = Job(cmd, env, world, hb_dir, log_dir, Watch(args.heartbeat_timeout, args.startup_timeout, exit_grace=0.0))
    return job, {"world": world, "tp": args.tp, "dp": args.dp, "msrun_pid": job.proc.pid, "logs": log_dir}


def ask_oracle(args, world: int, attempt: int, log: Log) -> ResumeAnswer:
    if args.resume_cmd:
        answer = ask_command(args.resume_cmd, world)
        if answer.saved_world is not None:  # only ckptd converts: give up rather than start fresh
            raise ConversionError(f"step {answer.step} was saved with world size {answer.saved_world}, the job has "
                                  f"{world}, and only ckptd can convert it")
        return answer
    if args.ckptd_url:
        return ask_ckptd_patiently(args, world, attempt, log)
    return ResumeAnswer(None, None, "no oracle configured", catalogued=False)


def ask_ckptd(args, world: int, attempt: int, log: Log, timeout: float = 10.0) -> ResumeAnswer:
    """One round with ckptd: ready (first rescan done), settle, ask, and (another layout) get a
    re-sharded copy."""
    answer = ask_ckptd_once(args.ckptd_url, args.run_name, world, args.settle_timeout, timeout, log,
                            attempt)
    target = job_layout_hash(args)
    if in_other_layout(answer, target):
        return resume_converted(args.ckptd_url, args.run_name, args.tp, args.dp, target, answer,
                                args.convert_timeout, lambda **f: log(attempt=attempt, **f))
    return answer


def ask_ckptd_patiently(args, world: int, attempt: int, log: Log) -> ResumeAnswer:
    """ask_ckptd, again and again while ckptd cannot be asked, for up to ``--oracle-wait`` s; then
    OracleError -- or the local scan when ``--oracle-fallback scan``."""
    fallback = (lambda why: fall_back_to_scan(args, attempt, log, why)) if args.oracle_fallback == "scan" else None
    return ask_patiently(lambda timeout: ask_ckptd(args, world, attempt, log, timeout=timeout), args.oracle_wait,
                         args.oracle_backoff, args.oracle_backoff_max, log, attempt, fallback)


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


def run(args) -> int:
    args.run_dir = os.path.abspath(args.run_dir)
    args.run_name = args.run_name or os.path.basename(args.run_dir)
    os.makedirs(args.run_dir, exist_ok=True)
    hb_dir = os.path.join(args.run_dir, "heartbeat")
    log = Log(os.path.join(args.run_dir, "launcher.log"))
    world = args.tp * args.dp
    # the scan fallback sees the disk itself: a ckptd that cannot be asked at start is no reason to stop
    fallback = (lambda why: None) if args.oracle_fallback == "scan" else None
    if refused := freshstart.refusal_at_start(
            args.ckptd_url, bool(args.ckptd_url or args.resume_cmd), args.run_dir, args.run_name, args.max_restarts,
            args.allow_fresh_start,
            lambda once: ask_patiently(once, args.oracle_wait, args.oracle_backoff, args.oracle_backoff_max, log, 0,
                                       fallback)):
        log(event=refused[0], reason=refused[1])
        return 2
    return supervise(args.run_dir, world, log, lambda attempt: ask_oracle(args, world, attempt, log),
                     lambda attempt, resume_file, _answer: start_job(args, attempt, hb_dir, resume_file),
                     Restarts(args.max_restarts, args.backoff, args.backoff_max, args.poll), fresh=args.fresh,
                     fresh_start=FreshStart(allowed=args.allow_fresh_start))


def main(argv: list[str] | None = None) -> int:
    install_sigterm()
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
