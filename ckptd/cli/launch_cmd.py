"""``ckptd launch [options] -- COMMAND...``: run any MindSpore job with automatic resume (the edge;
the work is :mod:`ckptd.launcher.command`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ckptd.launcher.template import PLACEHOLDERS, PRESETS

EPILOG = ("placeholders for --resume-args / --resume-env: "
          + "; ".join(f"{{{k}}} = {v}" for k, v in PLACEHOLDERS.items())
          + ". presets: " + "; ".join(f"{k} = {v!r}" for k, v in PRESETS.items()))


def register(sub: Any) -> None:
    p = sub.add_parser("launch", help="supervise a training command (e.g. msrun ...) and resume it after failures",
                       description="Start COMMAND, watch its ranks (heartbeats written by the ckptd MindSpore "
                                   "callback into $CKPTD_HEARTBEAT_DIR), and on a failure stop the whole job, ask "
                                   "ckptd where to resume and restart it with the resume point injected.",
                       epilog=EPILOG)
    p.add_argument("--run-dir", required=True, help="the run's directory (<root>/<run>): launcher.log, heartbeat/, "
                                                    "launcher/attempt_<k>/ (the command's output) go here")
    p.add_argument("--run-name", help="ckptd run name (default: basename of --run-dir)")
    p.add_argument("--world", type=int, help="ranks of the job (default: msrun's --worker_num in COMMAND)")
    p.add_argument("--ckptd-url", default=os.environ.get("CKPTD_URL"), help="resume oracle (default $CKPTD_URL)")
    p.add_argument("--resume-cmd", help="shell command printing a resume answer (instead of asking ckptd)")
    p.add_argument("--resume-args", metavar="TEMPLATE", help="arguments appended to COMMAND when resuming, e.g. "
                                                             "'--load_checkpoint {checkpoint_dir} --resume_training "
                                                             "{resume_file}'")
    p.add_argument("--resume-preset", choices=sorted(PRESETS), help="a known --resume-args template")
    p.add_argument("--resume-env", action="append", default=[], metavar="NAME=TEMPLATE",
                   help="an environment variable set when resuming (repeatable)")
    p.add_argument("--layout", metavar="tp=N,dp=M[,pp=K]",
                   help="the job's parallel layout (ranks = tp*dp*pp): a step saved in another layout (another world "
                        "size or tp/dp split) is resumed from a copy ckptd re-shards for it; without it, a step of "
                        "another world size stops the launcher (exit 2)")
    p.add_argument("--convert-timeout", type=float, default=300.0,
                   help="elastic restart: wait at most this long for ckptd to re-shard a step for --layout (s)")
    p.add_argument("--exclude-unreachable", action="store_true",
                   help="resume from the newest step with no shard on a node whose ckptd is silent (a node was lost)")
    p.add_argument("--fresh", action="store_true", help="do not ask the oracle before the first attempt (refused "
                                                       "when the run dir holds committed saves)")
    p.add_argument("--allow-fresh-start", action="store_true",
                   help="allow training from step 0 over saves ckptd cannot see (a run dir outside ckptd's root, no "
                        "oracle configured, --fresh over existing saves); without it the launcher refuses (exit 2)")
    p.add_argument("--settle-timeout", type=float, default=60.0,
                   help="before asking ckptd, wait up to this long for its verdict on the newest save on disk")
    p.add_argument("--oracle-wait", type=float, default=120.0, help="keep asking an unreachable ckptd this long (s)")
    p.add_argument("--oracle-backoff", type=float, default=0.5)
    p.add_argument("--oracle-backoff-max", type=float, default=10.0)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--backoff", type=float, default=1.0, help="first restart delay (s); doubles each restart")
    p.add_argument("--backoff-max", type=float, default=30.0)
    p.add_argument("--heartbeat-timeout", type=float, default=60.0, help="a training rank silent this long is hung")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="allowance for import + cluster init")
    p.add_argument("--exit-grace", type=float, default=10.0,
                   help="after every rank's clean exit marker, wait this long for the processes to exit")
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. msrun --worker_num=2 ...")
    p.set_defaults(handler=cmd_launch)


def cmd_launch(args: argparse.Namespace) -> int:
    from ckptd.launcher.command import LaunchError, LaunchSpec, parse_layout, prepare, run
    from ckptd.launcher.supervise import Restarts, Watch, install_sigterm

    if args.resume_args and args.resume_preset:
        print("ckptd: error: give --resume-args or --resume-preset, not both", file=sys.stderr)
        return 2
    try:
        command, run_dir, world, run_name = prepare(args.command, args.run_dir, args.world, args.run_name)
        layout = parse_layout(args.layout, world)
        spec = LaunchSpec(
            command=command, run_dir=run_dir, world=world, run_name=run_name, ckptd_url=args.ckptd_url,
            resume_cmd=args.resume_cmd, resume_args=args.resume_args or PRESETS.get(args.resume_preset or ""),
            resume_env=args.resume_env, fresh=args.fresh, allow_fresh_start=args.allow_fresh_start, split=layout, convert_timeout=args.convert_timeout,
            settle_timeout=args.settle_timeout,
            oracle_wait=args.oracle_wait, oracle_backoff=args.oracle_backoff,
            oracle_backoff_max=args.oracle_backoff_max, exclude_unreachable=args.exclude_unreachable,
            watch=Watch(args.heartbeat_timeout, args.startup_timeout, args.exit_grace),
            restarts=Restarts(args.max_restarts, args.backoff, args.backoff_max, args.poll))
        install_sigterm()
        return run(spec)
    except LaunchError as err:
        print(f"ckptd: error: {err}", file=sys.stderr)
        return 2
