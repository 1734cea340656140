"""``ckptd inspect`` and ``ckptd verify``: the file-level public contract (see docs/CLI.md).

JSON output carries a ``schema`` key; fields are only ever added within a schema version.

``ckptd verify`` checks every file as what its bytes say it is (``verify.sniff_kind``), whatever
its name: MindSpore's strategy files end in ``.ckpt`` too and sit beside checkpoints (a run's
``strategy.ckpt`` and ``strategy/*_rank_<r>.ckpt``, a conversion's ``strategy_*.ckpt``). A
strategy file is valid when it parses as a ``ParallelStrategyMap`` (or JSON strategy) whose
layouts agree; its line reads ``ok   PATH (strategy proto, N parameter layouts, S stage(s) x D
devices)``, its JSON row has ``"kind": "strategy"`` (checkpoints: ``"checkpoint"``) and a
``strategy`` summary, and ``--require-crc`` does not apply to it (the format has no CRC).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Iterator

from ckptd.errors import CkptdError

if TYPE_CHECKING:  # the format readers (numpy, crypto) load when a command reads a file: --help stays light
    from ckptd.format.verify import FileReport

INSPECT_SCHEMA = "ckptd.inspect/1"
VERIFY_SCHEMA = "ckptd.verify/1"
CHECKPOINT_SUFFIXES = (".ckpt", ".safetensors")


def register(sub: Any) -> None:
    p = sub.add_parser("inspect", help="list a checkpoint file's entries and properties")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema ckptd.inspect/1)")
    p.add_argument("--key-file", metavar="F", help="file holding the raw decryption key bytes")
    p.add_argument("--no-crc", action="store_true", help="skip recomputing the CRC (avoids a full read)")
    p.set_defaults(handler=cmd_inspect)

    v = sub.add_parser(
        "verify",
        help="check checkpoint (and strategy) files completely; exit 0 only if all are valid",
        description="Check files completely. Each file is checked as what its bytes say it is: a checkpoint "
        "(.ckpt, encrypted .ckpt, safetensors), or a MindSpore strategy file (which is also named *.ckpt, e.g. a "
        "run's strategy.ckpt or a conversion's strategy_*.ckpt), valid when it parses and its layouts agree. "
        "Exit 0 only if every file is valid.",
    )
    v.add_argument("paths", nargs="*", metavar="PATH",
                   help="files, or directories searched for *.ckpt/*.safetensors (strategy files among them are "
                   "checked as strategies)")
    v.add_argument("--run", help="re-verify a catalogued run instead of files (with --step: one step)")
    v.add_argument("--step", type=int, help="with --run: only this step")
    v.add_argument("--db", metavar="URL", help="with --run: catalog URL")
    v.add_argument("--root", metavar="DIR", help="with --run: checkpoint root")
    v.add_argument("--progress", action="store_true", help="with --run: progress bar even when not a terminal")
    v.add_argument("--key-file", metavar="F", help="file holding the raw decryption key bytes")
    v.add_argument("--json", action="store_true", help="machine-readable output (schema ckptd.verify/1)")
    v.add_argument(
        "--require-crc", action="store_true",
        help="treat a .ckpt without a CRC trailer as invalid (catches cuts at record boundaries); not applied to "
        "strategy files, which have no CRC",
    )
    v.set_defaults(handler=cmd_verify)


def _key(args: argparse.Namespace) -> bytes | None:
    from ckptd.format import crypto

    return crypto.load_key_file(args.key_file) if args.key_file else None


def rate_text(nbytes: int, seconds: float) -> str:
    """``1.2 GiB in 0.85 s (1.4 GiB/s)``: throughput as the CLI prints it."""
    per_s = nbytes / seconds if seconds > 0 else 0.0
    return f"{human_bytes(nbytes)} in {seconds:.2f} s ({human_bytes(int(per_s))}/s)"


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def inspect_file(path: str, key: bytes | None, check_crc: bool = True) -> dict[str, Any]:
    """The ``ckptd.inspect/1`` document for one file."""
    from ckptd.format.checkpoint import open_checkpoint

    with open_checkpoint(path, key) as ckpt:
        crc: dict[str, Any] = {"present": ckpt.crc is not None, "stored": None, "computed": None, "valid": None}
        if ckpt.crc is not None:
            crc["stored"] = ckpt.crc.stored
            if check_crc:
                crc["computed"] = ckpt.compute_crc()
                crc["valid"] = crc["computed"] == ckpt.crc.stored
        entries = []
        for ent in ckpt.entries.values():
            row = ent.to_dict()
            if ent.is_string or (ent.is_scalar and ent.expected_nbytes() == ent.nbytes):
                try:
                    row["value"] = ckpt.value(ent.name)
                except CkptdError as err:
                    row["value"] = None
                    row["error"] = err.message
            entries.append(row)
        return {
            "schema": INSPECT_SCHEMA,
            "path": os.path.abspath(path),
            "format": ckpt.format,
            "encryption": ckpt.encryption.value if ckpt.encryption else None,
            "size": os.path.getsize(path),
            "crc": crc,
            "metadata": ckpt.metadata,
            "entries": entries,
            "problems": [p.to_dict() for p in ckpt.problems],
        }


def cmd_inspect(args: argparse.Namespace) -> int:
    doc = inspect_file(args.file, _key(args), check_crc=not args.no_crc)
    if args.json:
        json.dump(doc, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0 if not doc["problems"] and doc["crc"]["valid"] is not False else 1
    crc = doc["crc"]
    crc_text = "absent" if not crc["present"] else {True: "valid", False: "INVALID", None: "present (not checked)"}[crc["valid"]]
    print(f"file:       {doc['path']}")
    print(f"format:     {doc['format']}  size: {human_bytes(doc['size'])}")
    print(f"encryption: {doc['encryption'] or 'none'}")
    print(f"crc:        {crc_text}" + (f" ({crc['stored']:#010x})" if crc["present"] else ""))
    for k, v in doc["metadata"].items():
        print(f"metadata:   {k} = {v}")
    rows = [("NAME", "DTYPE", "SHAPE", "BYTES", "VALUE")]
    for e in doc["entries"]:
        value = "" if "value" not in e else repr(e["value"])
        rows.append((e["name"], e["dtype"], str(tuple(e["shape"])), str(e["bytes"]), value[:40]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + ("  " + r[4] if r[4] else ""))
    print(f"{len(doc['entries'])} entries, {human_bytes(sum(e['bytes'] for e in doc['entries']))} of tensor data")
    for p in doc["problems"]:
        print(f"PROBLEM: {p['message']} (hint: {p['hint']})")
    return 0 if not doc["problems"] and crc["valid"] is not False else 1


def expand_paths(paths: list[str]) -> Iterator[str]:
    """Files as given; directories walked (sorted) for checkpoint files. Missing paths pass through."""
    for path in paths:
        if os.path.isdir(path):
            found = False
            for root, dirs, names in os.walk(path):
                dirs.sort()
                for name in sorted(names):
                    if name.endswith(CHECKPOINT_SUFFIXES):
                        found = True
                        yield os.path.join(root, name)
            if not found:
                raise CkptdError("no *.ckpt or *.safetensors files under this directory", path=path)
        else:
            yield path


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # verify_path reports the missing or unreadable file


def _problem_line(report: FileReport, code: str, message: str, offset: int | None, hint: str) -> str:
    where = f" @ byte {offset}" if offset is not None else ""
    return f"FAIL {report.path}{where}: {message} [{code}]" + (f" (hint: {hint})" if hint else "")


def cmd_verify(args: argparse.Namespace) -> int:
    if args.run:
        if args.paths:
            raise CkptdError("give either PATH... or --run, not both", hint="ckptd verify --run R [--step S]")
        from ckptd.cli.catalog_cmds import cmd_verify_run

        return cmd_verify_run(args)
    if not args.paths:
        raise CkptdError("nothing to verify", hint="ckptd verify PATH... or ckptd verify --run R [--step S]")
    key = _key(args)
    t0 = time.perf_counter()
    from ckptd.cli import progress
    from ckptd.format.verify import verify_path

    paths = list(expand_paths(args.paths))
    sizes = [_size(p) for p in paths]
    reports = []
    with progress.bar(args, "verify", "B", sum(sizes), scale=True) as bar:
        for n, path in enumerate(paths):
            reports.append(verify_path(path, key, require_crc=args.require_crc))
            bar(sum(sizes[: n + 1]), sum(sizes))
    seconds = time.perf_counter() - t0
    nbytes = sum(r.size for r in reports)
    ok = all(r.ok for r in reports)
    if args.json:
        json.dump({"schema": VERIFY_SCHEMA, "ok": ok, "files": [r.to_dict() for r in reports], "bytes": nbytes,
                   "seconds": round(seconds, 6), "bytes_per_second": round(nbytes / seconds) if seconds > 0 else None},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for r in reports:
            if r.ok and r.kind == "strategy" and r.strategy is not None:
                stages, devices = r.strategy["stages"], r.strategy["devices_per_stage"]
                print(f"ok   {r.path} (strategy {r.format}, {r.entries} parameter layouts, {stages} "
                      f"stage{'s' if stages != 1 else ''} x {devices} device{'s' if devices != 1 else ''})")
            elif r.ok:
                enc = f", {r.encryption}" if r.encryption else ""
                print(f"ok   {r.path} ({r.format}{enc}, {r.entries} entries, crc {r.crc})")
            for p in r.problems:
                print(_problem_line(r, p.code, p.message, p.offset, p.hint))
        bad = sum(not r.ok for r in reports)
        print(f"{len(reports) - bad} valid, {bad} invalid; {rate_text(nbytes, seconds)}")
    return 0 if ok else 1
