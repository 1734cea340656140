"""The ``ckptd`` command line: argument parsing and output only; work is delegated to the domain."""

from __future__ import annotations

import argparse
import logging
import sys

from ckptd import __version__
from ckptd.cli import catalog_cmds, convert_cmd, files, service
from ckptd.errors import CkptdError

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptd", description="Checkpoint management for MindSpore training.")
    parser.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    files.register(sub)
    service.register(sub)
    catalog_cmds.register(sub)
    convert_cmd.register(sub)
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


def run() -> None:
    sys.exit(main())
