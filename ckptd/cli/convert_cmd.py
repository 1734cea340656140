"""``ckptd convert``: re-shard a MindSpore checkpoint to another parallel layout.

Usage (these flags are a public contract; keep them)::

    ckptd convert --src DIR --src-strategy OLD (--to-strategy NEW|none | --to-layout tp=T,dp=D[,pp=P])
                  --out DIR [--step N] [--rank R ...] [--plan] [--workers N] [--key-file F]
                  [--out-key-file F] [--format ckpt|safetensors] [--prefix checkpoint_] [--json]

--src DIR           source checkpoints, one per rank: ``DIR/rank_<r>/<file>.ckpt`` (or .safetensors),
                    as ``mindspore.transform_checkpoints`` expects, or a MindFormers output directory
                    (``<out>`` or ``<out>/checkpoint``: ``rank_<r>/{P}_rank_<r>[_k]-{E}_{S}.ckpt``;
                    ``meta.json`` is never read). Missing ranks are fine while a replica of every
                    needed slice exists. Or ``s3://BUCKET/PREFIX/RUN/STEP``, a step on the object
                    tier: fetched (every object checked against the step's manifest) into a
                    temporary directory next to --out, converted from there, removed afterwards;
                    --src-strategy defaults to the step's own strategy file(s) there.
--src-strategy OLD  the source job's strategy file (MindSpore protobuf or JSON; pipeline jobs: the
                    merged file), or a DIRECTORY of per-rank strategy files (MindFormers'
                    ``<out>/strategy/``, one stage per file under pipeline parallelism), which is
                    merged; ``none`` = one unsharded checkpoint in ``rank_0``. It must describe the
                    files: every rank's file must hold its stage's parameters at the slice shapes it
                    implies, replicas must hold equal bytes and no rank may hold another's bytes where
                    it implies different slices -- otherwise every disagreement, per rank, is
                    printed and nothing is written (ckptd/convert/consistency.py; the byte
                    comparisons read one page per tensor of plaintext sources, encrypted sources get
                    the header checks only).
--to-strategy NEW   the destination strategy file (or directory of per-rank files), or ``none`` for
                    one unsharded checkpoint.
--to-layout SPEC    instead of --to-strategy: derive it from the source (``tp=..,dp=..[,pp=..]``; rule in
                    ckptd/convert/layouts.py); the derived file is saved as
                    ``OUT/strategy_tp<T>_dp<D>_pp<P>.ckpt``.
--out DIR           output: ``DIR/rank_<r>/<prefix><r>.ckpt`` per destination rank (``rank_0`` only for
                    ``none``). Existing ``rank_<r>`` directories are never overwritten; a refused
                    conversion does not create DIR.
--step S            when a rank directory holds several checkpoints, pick one save:
                    ``[PREFIX-][EPOCH_]STEP[_breakpoint]`` matched against the file names
                    (``200``, ``2_200``; ``llama_1-2_200`` picks the restart that appended ``_1`` to
                    the prefix; ``2_200_breakpoint`` picks a breakpoint save, which is never picked
                    otherwise). Never guessed by name order or mtime; the files picked must all be of
                    one save.
--rank R            convert only destination rank R (repeatable): several machines can share a job.
--plan              print, per destination rank, the source shards read, bytes to move and the
                    estimated peak memory; write nothing. Impossible conversions exit 1 either way.
--workers N         destination ranks converted in parallel (default min(4, CPUs)); peak memory is
                    about N x the per-worker peak that --plan prints.
--key-file F        raw key bytes to decrypt encrypted sources (mode auto-detected).
--out-key-file F    encrypt the output (AES-GCM) with these raw key bytes.
--format FMT        output format, ``ckpt`` (default; with MindSpore's CRC trailer unless encrypted)
                    or ``safetensors`` (with ``crc_num`` metadata).
--prefix P          output file prefix (default ``checkpoint_``, like MindSpore's examples).
--json              machine-readable output.

Entries that are in no strategy (global_step, epoch_num, step_num, ...) are copied from source rank
``r % src_devices`` like MindSpore, except ``rank_id``, which is set to the destination rank.
Exit status: 0 done (every file verified), 1 refused or failed (nothing left that
looks complete), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ckptd.cli.files import human_bytes as _human
from ckptd.cli.files import rate_text
from ckptd.errors import CkptdError

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert",
        help="re-shard checkpoints to another parallel layout (streaming, verified, atomic)",
        description="Re-shard per-rank MindSpore checkpoints from one strategy to another.",
    )
    p.add_argument("--src", metavar="DIR",
                   help="directory of rank_<r>/ source checkpoints, a MindFormers output dir, or a step on the "
                        "object tier: s3://BUCKET/PREFIX/RUN/STEP")
    p.add_argument("--src-strategy", metavar="OLD",
                   help="source strategy file, directory of per-rank strategy files, or 'none' (unsharded)")
    p.add_argument("--run", metavar="R", help="instead of --src: a catalogued run (with --step; registers the result)")
    p.add_argument("--db", metavar="URL", help="with --run: catalog URL")
    p.add_argument("--root", metavar="DIR", help="with --run: checkpoint root")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-strategy", metavar="NEW", help="destination strategy file (or per-rank directory), or 'none'")
    to.add_argument("--to-layout", metavar="SPEC", help="derive the destination: tp=..,dp=..[,pp=..]")
    p.add_argument("--out", metavar="DIR", help="output directory (required unless --plan)")
    p.add_argument("--step", metavar="S",
                   help="pick this save when rank dirs hold several: [PREFIX-][EPOCH_]STEP[_breakpoint]")
    p.add_argument("--rank", type=int, action="append", metavar="R", help="convert only this destination rank (repeatable)")
    p.add_argument("--plan", action="store_true", help="print the plan without moving data")
    p.add_argument("--workers", type=int, metavar="N", help="destination ranks converted in parallel")
    p.add_argument("--key-file", metavar="F", help="raw key bytes of encrypted sources")
    p.add_argument("--out-key-file", metavar="F", help="encrypt the output (AES-GCM) with this raw key")
    p.add_argument("--format", choices=("ckpt", "safetensors"), default="ckpt", help="output format")
    p.add_argument("--prefix", default="checkpoint_", help="output file prefix (default checkpoint_)")
    p.add_argument("--json", action="store_true", help="JSON output")
    p.set_defaults(handler=run_convert)
    return p


def _usage(message: str) -> CkptdError:
    err = CkptdError(message)
    err.code = "usage"
    return err


def _strategies(args: argparse.Namespace) -> tuple[Any, Any, str | None]:
    from ckptd.convert.layouts import derive_strategy
    from ckptd.split import parse_split
    from ckptd.convert.sources import resolve_strategy

    if args.src_strategy is None:  # a Checkpoint 2.0 iteration: its metadata.json is the source layout
        from ckptd.convert.iteration_source import iteration_source

        src = iteration_source(args.src)[1]
    else:
        src = None if args.src_strategy.lower() == "none" else resolve_strategy(args.src_strategy)
    if args.to_layout is not None:
        split = parse_split(args.to_layout)
        if src is None:
            raise _usage("--to-layout derives from the source strategy; it needs --src-strategy FILE")
        dst = derive_strategy(src, split.tp, split.dp, split.pp)
        name = f"strategy_tp{split.tp}_dp{split.dp}_pp{dst.stages}.ckpt"
        return src, dst, name
    dst = None if args.to_strategy.lower() == "none" else resolve_strategy(args.to_strategy)
    return src, dst, None


def _print_plan(plan: Any, workers: int) -> None:
    print(f"source: {plan.src_world} rank(s), {plan.src_stage_devices} per stage; destination: {plan.dst_world} rank(s)")
    for note in plan.notes:
        print(f"note: {note}")
    for r in plan.ranks:
        reads = ", ".join(f"rank_{s}" for s in r.src_ranks) or "-"
        print(f"rank {r.rank} (stage {r.stage}): {len(r.tasks)} tensors, {_human(r.bytes_out)} out, reads "
              f"{_human(r.bytes_read)} from {reads}; peak ~{_human(r.peak_bytes)}")
    print(f"total: {_human(plan.bytes_out)} to write, {_human(plan.bytes_read)} to read; estimated peak memory "
          f"~{_human(plan.peak_bytes * workers)} with {workers} worker(s)")


def run_convert(args: argparse.Namespace) -> int:
    from ckptd.convert.execute import convert, plan_from_dir
    from ckptd.format.crypto_blocks import load_key_file
    from ckptd.format.strategy import encode_strategy

    if args.run:
        return _run_from_catalog(args)
    from ckptd.cli import convert_s3

    if convert_s3.is_object_url(args.src):
        return _convert_from_objects(args)
    from ckptd.convert.iteration_source import is_iteration_dir

    if not args.src or not (args.src_strategy or is_iteration_dir(args.src)):
        raise _usage("give --src DIR --src-strategy OLD (an iteration_<it>/ directory needs none), or --run R --step S")

    if not args.plan and not args.out:
        raise _usage("--out DIR is required (or use --plan)")
    if args.workers is not None and args.workers < 1:
        raise _usage("--workers must be at least 1")
    key = load_key_file(args.key_file) if args.key_file else None
    out_key = load_key_file(args.out_key_file) if args.out_key_file else None
    src, dst, derived_name = _strategies(args)
    plan = plan_from_dir(args.src, src, dst, step=args.step, ranks=args.rank, key=key)
    workers = max(1, min(args.workers or min(4, os.cpu_count() or 1), len(plan.ranks) or 1))
    if args.plan:
        if args.json:
            print(json.dumps({**plan.to_dict(), "workers": workers, "peak_bytes": plan.peak_bytes * workers}, indent=2))
        else:
            _print_plan(plan, workers)
        return EXIT_OK
    # a derived target strategy is part of the written set (committed by its manifest with the ranks)
    strategy_file = (derived_name, encode_strategy(dst, "proto")) if derived_name is not None and dst is not None \
        else None
    from ckptd.cli import progress

    with progress.bar(args, "convert", "B", plan.bytes_out, scale=True) as bar:
        report = convert(args.src, src, dst, args.out, workers=workers, key=key, out_key=out_key,
                         out_format=args.format, prefix=args.prefix, plan=plan, strategy_file=strategy_file,
                         progress=bar)
    strategy_path = os.path.join(report.out_dir, derived_name) if strategy_file is not None else None
    if args.json:
        print(json.dumps({**report.to_dict(), "derived_strategy": strategy_path}, indent=2))
    else:
        for r in report.ranks:
            print(f"rank {r.rank}: {r.path} ({_human(r.bytes)}, {r.tensors} tensors, {r.pieces_verified} regions verified)")
        print(f"converted {len(report.ranks)} rank(s), {rate_text(report.bytes_written, report.seconds)}; all verified")
        if strategy_path:
            print(f"destination strategy: {strategy_path}")
    return EXIT_OK


def _convert_from_objects(args: argparse.Namespace) -> int:
    """``--src s3://...``: the step fetched next to ``--out`` (checked against its manifest), converted
    from there, the temporary copy removed whatever happens (``ckptd.cli.convert_s3``)."""
    import contextlib

    from ckptd.cli import convert_s3, progress

    if not args.out:
        raise _usage("--src s3://... needs --out DIR (also with --plan): the step is fetched next to it first")
    with contextlib.ExitStack() as stack:
        with progress.bar(args, f"fetch {args.src}", "B", scale=True) as bar:
            step = stack.enter_context(convert_s3.fetched(args.src, args.out, progress=bar))
        if args.src_strategy is None and not step.iteration:
            if step.strategy is None:
                raise _usage(f"the step at {args.src} has no strategy file on the object tier: give --src-strategy "
                             "FILE (or none for one unsharded checkpoint)")
            args.src_strategy = step.strategy
        args.src = step.src
        return run_convert(args)


def _run_from_catalog(args: argparse.Namespace) -> int:
    """``--run R --step S``: convert a verified catalogued step and register it with lineage."""
    from ckptd.cli.catalog_cmds import catalog_sessions
    from ckptd.format.crypto_blocks import load_key_file
    from ckptd.service.conversions import convert_step
    from ckptd.split import parse_split

    if args.src or args.src_strategy or args.plan or args.rank:
        raise _usage("--run works with --step, --to-strategy/--to-layout, [--out], key files and --workers only")
    if args.step is None or not str(args.step).isdigit():
        raise _usage("--run needs --step N (the step as `ckptd ls RUN` shows it)")
    from ckptd.cli import progress

    settings, sessions = catalog_sessions(args)
    with progress.bar(args, f"convert {args.run} step {args.step}", "B", scale=True) as bar:
        doc = convert_step(
            sessions, settings.storage, args.run, int(args.step), to_strategy=args.to_strategy,
            split=parse_split(args.to_layout) if args.to_layout is not None else None,
            out_dir=args.out, key=load_key_file(args.key_file) if args.key_file else settings.encryption_key(),
            out_key=load_key_file(args.out_key_file) if args.out_key_file else None, workers=args.workers,
            node=settings.node_name, progress=bar,
        )
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    elif doc.get("reused"):
        print(f"run {args.run} step {args.step} is already converted to target {doc['target_strategy_hash'][:19]}: "
              f"{doc['out_dir']} (unchanged since it was verified; nothing rewritten)")
    else:
        rep = doc.get("report") or {}
        rate = f"{rate_text(rep['bytes_written'], rep['seconds'])}; " if "bytes_written" in rep else ""
        print(f"converted run {args.run} step {args.step} -> {doc['out_dir']} (catalogued as a converted copy, "
              f"target {doc['target_strategy_hash'][:19]}); {rate}every slice verified")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """``python -m ckptd.cli.convert_cmd convert ...`` = ``ckptd convert ...`` (same exit codes)."""
    from ckptd.cli import main as ckptd_main

    return ckptd_main(argv)


if __name__ == "__main__":
    sys.exit(main())
