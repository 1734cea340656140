"""The ``ckptd`` command line: argument parsing and output only; work is delegated to the domain."""

from __future__ import annotations

import argparse
import logging
import sys

from typing import TYPE_CHECKING

from ckptd import __version__
from ckptd.cli import catalog_cmds, convert_cmd, fetch_cmd, files, launch_cmd, service
from ckptd.errors import CkptdError

if TYPE_CHECKING:  # pydantic is imported only by the commands that read settings: --help stays fast
    from pydantic import ValidationError

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptd", description="Checkpoint management for MindSpore training.")
    parser.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    files.register(sub)
    service.register(sub)
    catalog_cmds.register(sub)
    convert_cmd.register(sub)
    launch_cmd.register(sub)
    fetch_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # one-shot commands report through their output; daemon commands configure real logging
    logging.getLogger("ckptd").addHandler(logging.NullHandler())
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.handler(args))
    except CkptdError as err:
        print(f"ckptd: error: {err}", file=sys.stderr)
        return EXIT_USAGE if err.code == "usage" else EXIT_INVALID
    except KeyboardInterrupt:
        print("ckptd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as err:
        # a setting from a flag, CKPTD_* or the config file; pydantic is loaded if settings were read
        pydantic = sys.modules.get("pydantic")
        if pydantic is None or not isinstance(err, pydantic.ValidationError):
            raise
        print(f"ckptd: error: invalid configuration: {config_problems(err)} "
              "(hint: see `ckptd config show` and docs/CONFIG.md)", file=sys.stderr)
        return EXIT_USAGE


def config_problems(err: ValidationError) -> str:
    """One line per problem, without the offending values (a token may be among them)."""
    out = []
    for e in err.errors(include_input=False, include_url=False):
        loc = tuple(e.get("loc", ()))
        if loc[:1] == ("tokens",):
            loc = loc[:1] + (("<scope of a token>",) if len(loc) > 1 else ())  # dict keys are the secrets
        where = ".".join(str(p) for p in loc) or "settings"
        out.append(f"{where}: {str(e.get('msg', '')).removeprefix('Value error, ')}")
    return "; ".join(out)


def run() -> None:
    sys.exit(main())
