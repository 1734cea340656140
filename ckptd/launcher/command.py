"""``ckptd launch``: supervise any command with automatic resume (see :mod:`ckptd.launcher.supervise`).

Per attempt the command gets, in its environment, ``CKPTD_HEARTBEAT_DIR`` (where the ranks' heartbeats
and exit markers go -- the MindSpore callback writes them), ``CKPTD_ATTEMPT``, ``CKPTD_RUN_NAME``,
``CKPTD_URL`` when ckptd is the oracle, and, when resuming, ``CKPTD_RESUME_FILE`` (ckptd's whole answer
as JSON) plus the rendered ``--resume-args`` appended to the command and ``--resume-env`` variables
(:mod:`ckptd.launcher.template`). A fresh start gets none of the resume ones.

Elastic restart (``--layout tp=..,dp=..[,pp=..]``, the layout the job will run): when the step to
resume was saved in another layout -- another world size, or another tp/dp split of the same one --
the job resumes from ckptd's re-sharded copy (:mod:`ckptd.launcher.elastic`): the resume file's
``shards`` and every placeholder name the copy's files, never the saved ones. Without ``--layout`` a
step of another world size stops the launcher (exit 2): which split the job runs is not in its
command line, and loading shards of another layout as they are would be wrong.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field

from ckptd.launcher import elastic, freshstart, template
from ckptd.launcher.oracle import ConversionError, ResumeAnswer, ask_command, ask_http
from ckptd.launcher.supervise import JOB_ENV, Job, Log, Restarts, Watch, ask_ckptd_once, ask_patiently, supervise
from ckptd.split import ParallelSplit, SplitError, parse_split

_WORKER_NUM = re.compile(r"^--worker_num(?:=(\d+))?$")
_LOG_DIR = re.compile(r"^--log_dir(=.*)?$")


@dataclass
class LaunchSpec:
    command: list[str]
    run_dir: str
    world: int
    run_name: str
    ckptd_url: str | None = None
    resume_cmd: str | None = None
    resume_args: str | None = None
    resume_env: list[str] = field(default_factory=list)
    fresh: bool = False
    #: ``--allow-fresh-start``: train from step 0 even over saves the oracle cannot see
    allow_fresh_start: bool = False
    #: the job's declared split (``--layout``): elastic restarts from a re-sharded copy (None: refuse
    #: another world size)
    split: ParallelSplit | None = None
    convert_timeout: float = 300.0
    settle_timeout: float = 60.0
    oracle_wait: float = 120.0
    oracle_backoff: float = 0.5
    oracle_backoff_max: float = 10.0
    #: ask for the newest step with no shard on an unreachable node (a node was lost)
    exclude_unreachable: bool = False
    watch: Watch = field(default_factory=Watch)
    restarts: Restarts = field(default_factory=Restarts)


class LaunchError(ValueError):
    """A launch that cannot start as asked (refused before the job runs)."""


def world_from_command(command: list[str]) -> int | None:
    """msrun's ``--worker_num N`` / ``--worker_num=N`` (all ranks of the job, on every node)."""
    for i, arg in enumerate(command):
        m = _WORKER_NUM.match(arg)
        if m and (m.group(1) or (i + 1 < len(command) and command[i + 1].isdigit())):
            return int(m.group(1) or command[i + 1])
    return None


def per_attempt_log_dir(command: list[str], attempt: int) -> tuple[list[str], str | None]:
    """msrun's ``--log_dir D`` / ``--log_dir=D`` made ``D/attempt_<k>``: msrun rewrites its worker
    logs in place, so every attempt would overwrite the logs of the failure that ended the last one.
    Returns the command and the attempt's log directory (None: no ``--log_dir``)."""
    out = list(command)
    if os.path.basename(out[0]) != "msrun":
        return out, None
    for i, arg in enumerate(out):
        if arg.endswith(".py"):  # the script: what follows is its own arguments, not msrun's
            break
        m = _LOG_DIR.match(arg)
        if m is None:
            continue
        if m.group(1):
            target = os.path.join(m.group(1)[1:], f"attempt_{attempt}")
            out[i] = f"--log_dir={target}"
            return out, target
        if i + 1 < len(out):
            target = os.path.join(out[i + 1], f"attempt_{attempt}")
            out[i + 1] = target
            return out, target
    return out, None


def parse_layout(text: str | None, world: int) -> ParallelSplit | None:
    """``--layout`` checked before anything starts: parsable, and as many ranks as the job has."""
    if text is None:
        return None
    try:
        layout = parse_split(text, "--layout")
    except SplitError as err:
        raise LaunchError(f"bad --layout {text!r}: {err.message}; {err.hint}") from None
    if layout.world != world:
        raise LaunchError(f"--layout {layout} is {layout.world} ranks, the job has {world} (--world / msrun "
                          f"--worker_num): declare the layout the job will run")
    return layout


def prepare(command: list[str], run_dir: str, world: int | None, run_name: str | None) -> tuple[list[str], str, int, str]:
    """Check what can be checked before anything starts: (command, run dir, world, run name)."""
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        raise LaunchError("no command to launch: ckptd launch [options] -- msrun ... script.py [args]")
    if shutil.which(command[0]) is None:  # found now, not as a traceback from the first attempt
        raise LaunchError(f"command not found or not executable: {command[0]!r}")
    found = world_from_command(command)
    if world is None:
        if found is None:
            raise LaunchError("cannot tell the job's world size: give --world N (or msrun --worker_num N)")
        world = found
    elif found is not None and found != world:
        raise LaunchError(f"--world {world} but the command says msrun --worker_num {found}")
    if world < 1:
        raise LaunchError(f"--world must be >= 1, got {world}")
    run_dir = os.path.abspath(run_dir)
    return command, run_dir, world, run_name or os.path.basename(run_dir)


def refuse_other_world(spec: LaunchSpec, answer: ResumeAnswer, way_out: str) -> None:
    """Shards of another world size, and nothing to re-shard them with: loading them as they are would
    be wrong, a fresh start would throw the run away -- stop and say what to do."""
    if answer.saved_world is not None:
        raise ConversionError(f"step {answer.step} was saved with world size {answer.saved_world}, the job has "
                              f"{spec.world}: {way_out}, or launch with world size {answer.saved_world}")


def ask(spec: LaunchSpec, attempt: int, log: Log) -> ResumeAnswer:
    if spec.resume_cmd:
        answer = ask_command(spec.resume_cmd, spec.world)
        refuse_other_world(spec, answer, "only ckptd re-shards (--ckptd-url with --layout tp=..,dp=..); "
                                          "re-shard it first (ckptd convert)")
        return answer
    if not spec.ckptd_url:
        return ResumeAnswer(None, None, "no oracle configured", catalogued=False)
    url = spec.ckptd_url
    # a job whose own code loads the checkpoint (--resume-args / --resume-env: MindFormers) reads
    # files (an object-tier answer is fetched to files before it starts); restore() also loads a
    # rank's snapshot from its node's memory
    tiers = "file,object" if spec.resume_args or spec.resume_env else None

    def once(timeout: float) -> ResumeAnswer:
        # the conversion is part of the round: ckptd unreachable while re-sharding is waited for
        # with the same back-off as the question (ConversionUnavailable), within --oracle-wait
        answer = ask_ckptd_once(url, spec.run_name, spec.world, spec.settle_timeout, timeout, log,
                                attempt, spec.exclude_unreachable, spec.split, tiers)
        unreachable = (answer.body or {}).get("unreachable_nodes")
        if unreachable:  # the job would load shards from a node whose daemon is silent: say so
            log(attempt=attempt, event="warning", step=answer.step, unreachable_nodes=",".join(unreachable),
                reason="the answer depends on unreachable node(s); --exclude-unreachable skips such steps")
        if spec.split is None:
            refuse_other_world(spec, answer, "declare the job's layout (--layout tp=..,dp=..) to resume from "
                                             "a copy ckptd re-shards for it")
            return answer
        if answer.step is not None and (answer.body or {}).get("split") != str(spec.split):
            # a ckptd older than this launcher ignores ?split= and would call a step of the same world
            # size but another tp/dp split fine as it is: never hand the job such shards
            raise ConversionError(f"ckptd at {url} did not answer for the split {spec.split} (it is older than this "
                                  f"launcher): upgrade ckptd serve, or launch without --layout in the saved split")
        if answer.step is None or not (answer.conversion or {}).get("needed"):
            return answer  # ckptd says the step is in the job's split already (or there is none)

        def reask(step: int) -> ResumeAnswer:
            return ask_http(url, spec.run_name, spec.world, timeout=timeout, world_size=spec.world,
                            exclude_unreachable=spec.exclude_unreachable, split=spec.split, max_step=step,
                            tiers=tiers)

        return elastic.resume_converted(url, spec.run_name, spec.split, None, answer, spec.convert_timeout,
                                        lambda **f: log(attempt=attempt, **f), reask)

    return ask_patiently(once, spec.oracle_wait, spec.oracle_backoff, spec.oracle_backoff_max, log, attempt)


def start(spec: LaunchSpec, attempt: int, resume_file: str | None, answer: ResumeAnswer | None,
          arg_templates: list[str], env_templates: dict[str, str]) -> tuple[Job, dict]:
    hb_dir = os.path.join(spec.run_dir, "heartbeat")
    log_dir = os.path.join(spec.run_dir, "launcher", f"attempt_{attempt}")
    env = {k: v for k, v in os.environ.items() if k not in JOB_ENV}
    env.update(CKPTD_HEARTBEAT_DIR=hb_dir, CKPTD_ATTEMPT=str(attempt), CKPTD_RUN_NAME=spec.run_name)
    if spec.ckptd_url:
        env["CKPTD_URL"] = spec.ckptd_url
    cmd, msrun_logs = per_attempt_log_dir(spec.command, attempt)
    if resume_file and answer is not None and answer.body is not None:
        extra_args, extra_env = template.render(arg_templates, env_templates,
                                                template.values(answer.body, resume_file))
        cmd += extra_args
        env.update(extra_env)
        env["CKPTD_RESUME_FILE"] = resume_file
        # who loads the checkpoint: the job's own arguments (--resume-args / --resume-env, e.g.
        # MindFormers' load_checkpoint + resume_training) or the callback's restore()
        env["CKPTD_RESUME_BY"] = "args" if arg_templates or env_templates else "restore"
    job = Job(cmd, env, spec.world, hb_dir, log_dir, spec.watch)
    fields = {"world": spec.world, "layout": spec.split} if spec.split else {"world": spec.world}
    fields.update(pid=job.proc.pid, logs=log_dir)
    if msrun_logs:
        fields["msrun_logs"] = msrun_logs
    return job, fields


def run(spec: LaunchSpec) -> int:
    """Validate the templates, then supervise: 0 finished, 1 restarts used up, 2 the oracle said stop."""
    try:
        arg_templates, env_templates = template.check(spec.resume_args, spec.resume_env, spec.world)
    except template.TemplateError as err:
        raise LaunchError(str(err)) from None
    os.makedirs(spec.run_dir, exist_ok=True)
    log = Log(os.path.join(spec.run_dir, "launcher.log"))
    if refused := freshstart.refusal_at_start(
            spec.ckptd_url, bool(spec.ckptd_url or spec.resume_cmd), spec.run_dir, spec.run_name, spec.restarts.max_restarts, spec.allow_fresh_start,
            lambda once: ask_patiently(once, spec.oracle_wait, spec.oracle_backoff, spec.oracle_backoff_max, log, 0)):
        log(event=refused[0], reason=refused[1])
        return 2
    try:
        return supervise(spec.run_dir, spec.world, log, lambda attempt: ask(spec, attempt, log),
                         lambda attempt, resume_file, answer: start(spec, attempt, resume_file, answer,
                                                                    arg_templates, env_templates),
                         spec.restarts, fresh=spec.fresh,
                         fresh_start=freshstart.FreshStart(allowed=spec.allow_fresh_start))
    except template.TemplateError as err:  # an answer the templates cannot use: stop, never guess
        log(event="oracle_error", reason=str(err))
        return 2
