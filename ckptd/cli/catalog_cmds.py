"""Catalog commands: serve, ls, show, resume, gc, mark-bad, pin, config show, verify --run.

They work on the catalog directly (no server needed); ``serve`` runs watcher + API in one process.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import time
from typing import Any

from ckptd import advert
from ckptd.cli.reader import NoAnswer, add_url_flag, reader
from ckptd.cli.service import add_daemon_flags, settings_from
from ckptd.errors import CkptdError


def register(sub: Any) -> None:
    s = sub.add_parser("serve", help="run the daemon and the REST API (the main job)")
    add_daemon_flags(s)
    s.add_argument("--host", help="listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default 8470)")
    s.add_argument("--token-file", metavar="F", help="lines '<read|report|admin> <token>'")
    s.set_defaults(handler=cmd_serve)

    ls = sub.add_parser("ls", help="list runs, or the steps of a run")
    ls.add_argument("run", nargs="?")
    ls.add_argument("--state", help="only steps in this state")
    _common(ls)
    add_url_flag(ls)
    ls.set_defaults(handler=cmd_ls)

    sh = sub.add_parser("show", help="one step with its shards and verification results")
    sh.add_argument("run")
    sh.add_argument("step", type=int)
    _common(sh)
    sh.set_defaults(handler=cmd_show)

    r = sub.add_parser("resume", help="what the launcher would be told: the latest restorable step")
    r.add_argument("--run", required=True)
    r.add_argument("--max-step", type=int, help="resume at or before this step")
    r.add_argument("--exclude-unreachable", action="store_true",
                   help="pass over steps with a shard on a node whose daemon is silent (after a node loss)")
    r.add_argument("--world-size", type=int, help="target world size (says whether a conversion is needed)")
    r.add_argument("--skip-spikes", action="store_true", help="skip steps from the first loss spike on")
    r.add_argument("--no-lease", action="store_true", help="do not protect the answer from retention")
    r.add_argument("--tiers", default="file,object", metavar="T[,T]",
                   help="the tiers the answer may come from: file, object, memory (default file,object: a memory "
                        "snapshot is loadable only by the job's own ranks on their node, which `ckptd launch` asks for)")
    r.add_argument("--repair-tracker", action="store_true",
                   help="Checkpoint 2.0: rewrite latest_checkpointed_iteration.txt (atomically) to the answered "
                        "iteration, for a MindFormers launch that loads the checkpoint directory unmodified")
    r.add_argument("--dry-run", action="store_true", help="with --repair-tracker: say what would be written, write nothing")
    _common(r)
    add_url_flag(r)
    r.set_defaults(handler=cmd_resume)

    g = sub.add_parser("gc", help="apply retention: keep newest N restorable, every K-th, pinned")
    g.add_argument("--run", help="one run (default: all)")
    g.add_argument("--keep-last", type=int, default=5)
    g.add_argument("--keep-every", type=int)
    g.add_argument("--dry-run", action="store_true", help="show the plan only")
    _common(g, root=True)
    g.set_defaults(handler=cmd_gc)

    for name, helptext in (("mark-bad", "never resume from this step"), ("unmark-bad", "undo mark-bad"),
                           ("pin", "retention never deletes this step"), ("unpin", "undo pin")):
        m = sub.add_parser(name, help=helptext)
        m.add_argument("--run", required=True)
        m.add_argument("--step", type=int, required=True)
        if name == "mark-bad":
            m.add_argument("--reason")
        _common(m)
        m.set_defaults(handler=cmd_mark, action=name)

    c = sub.add_parser("config", help="configuration")
    c_sub = c.add_subparsers(dest="config_command", metavar="COMMAND")
    cs = c_sub.add_parser("show", help="effective configuration (secrets masked)")
    add_daemon_flags(cs)
    cs.set_defaults(handler=cmd_config_show)


def _common(p: argparse.ArgumentParser, root: bool = False) -> None:
    p.add_argument("--db", metavar="URL", help="catalog URL (default: $CKPTD_DB or embedded SQLite)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    if root:
        p.add_argument("--root", metavar="DIR", help="checkpoint root (files outside it are never deleted)")


def catalog_sessions(args: argparse.Namespace):  # noqa: ANN202
    """(settings, sessionmaker) of the catalog the command line names, its schema checked."""
    from sqlalchemy.orm import sessionmaker

    from ckptd.catalog.db import make_engine, require_current_schema
    from ckptd.settings import Settings

    overrides = {k: getattr(args, k) for k in ("db", "root") if getattr(args, k, None)}
    settings = Settings(**overrides)
    engine = make_engine(settings.db)
    require_current_schema(engine)
    return settings, sessionmaker(engine, expire_on_commit=False)


def _emit(args: argparse.Namespace, doc: Any, text: str) -> None:
    if args.json:
        json.dump(doc, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(text)


def _table(rows: list[tuple], header: tuple) -> str:
    cells = [tuple(str(c) if c is not None else "-" for c in r) for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from ckptd.api.app import create_app

    extra = {k: v for k, v in (("host", args.host), ("port", args.port), ("token_file", args.token_file)) if v is not None}
    settings = settings_from(args, **extra)  # validated like every other source (token_file -> Path)
    if not settings.all_tokens() and not _is_loopback(settings.host):
        raise CkptdError(
            f"refusing to listen on {settings.host} without authentication",
            hint="configure tokens (--token-file or CKPTD_TOKENS) or listen on 127.0.0.1",
        )
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(settings)
    # ckptd ls / resume on this machine ask this daemon instead of opening the catalog (ckptd.advert)
    from ckptd.configfile import default_db_url

    ad = advert.advertise(settings.db or default_db_url(), local_url(settings.host, settings.port))
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="info", access_log=settings.access_log)
    finally:
        advert.withdraw(ad)
    return 0


def local_url(host: str, port: int) -> str:
    """How a process on this machine reaches a server listening on ``host``."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_ls(args: argparse.Namespace) -> int:
    with reader(args) as rd:  # the daemon's API (--ckptd-url, $CKPTD_URL) or the catalog
        if args.run is None:
            runs = rd.list_runs()
            nodes = rd.list_nodes()
            live = {n["name"]: n["reachable"] for n in nodes}
            rows = [(r["name"], r["layout"], r["world_size"], r["latest_restorable_step"],
                     ", ".join(f"{k}={v}" for k, v in sorted(r["steps"].items())),
                     ", ".join(f"{n}{'' if live.get(n, True) else ' (UNREACHABLE)'}" for n in r["nodes"])) for r in runs]
            text = _table(rows, ("RUN", "LAYOUT", "WORLD", "LATEST RESTORABLE", "STEPS", "NODES")) if rows else "no runs catalogued"
            if nodes:
                text += "\n\n" + _table([(n["name"], "reachable" if n["reachable"] else "UNREACHABLE",
                                           f"{n['seconds_since_heartbeat']:.0f}s", sum(n["shards"].values())) for n in nodes],
                                         ("NODE", "LIVENESS", "LAST HEARTBEAT", "SHARDS"))
            _emit(args, runs, text)
        else:
            steps = rd.list_steps(args.run, args.state)
            rows = [("?" if x["training_step"] is None else x["training_step"], x["epoch"], x["step"],
                     "" if x["incarnation"] is None else x["incarnation"], x["kind"], x["state"],
                     "yes" if x["restorable"] else "no",
                     ",".join(x["tiers"]) or "-", "bad" if x["marked_bad"] else ("pinned" if x["pinned"] else ""),
                     (x["reason"] or "")[:80]) for x in steps]
            _emit(args, steps, _table(rows, ("STEP", "EPOCH", "NAME STEP", "INC", "KIND", "STATE", "RESTORABLE", "TIERS",
                                             "MARK", "REASON")))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from ckptd.service import catalog

    settings, sessions = catalog_sessions(args)
    with sessions() as s:
        doc = catalog.show_step(s, args.run, args.step, settings.node_timeout)
    # steps are addressed by their global step; the file names' (epoch, step in epoch) is how it is named
    step = "?" if doc["training_step"] is None else doc["training_step"]
    named = f"epoch {doc['epoch']}" + (f", file-name step {doc['step']}" if doc["step"] != step else "")
    head = (f"run {args.run} step {step} ({named}): {doc['state']}"
            f"{' — ' + doc['reason'] if doc['reason'] else ''}\nstrategy: {doc['strategy_file'] or '-'}\n"
            f"whole on: {', '.join(doc['tiers']) or 'no tier'}")
    rows = [(x["rank"], x["state"], x["crc"], x["encryption"] or "-", x["size"], _node_cell(x), x["error"] or "",
             x["path"]) for x in doc["shards"]]
    text = head + "\n" + _table(rows, ("RANK", "STATE", "CRC", "ENC", "BYTES", "NODE", "ERROR", "PATH"))
    held = [cp for x in doc["shards"] for cp in x.get("copies") or []] + doc["copies_without_file"]
    others = [(cp["rank"], cp["tier"], cp["state"], cp["size"], cp["node"] or "-", cp["error"] or "", cp["location"])
              for cp in held if cp["tier"] != "file"]  # the file tier's copies are the rows above
    if others:
        text += "\n\ncopies on other tiers:\n" + _table(others, ("RANK", "TIER", "STATE", "BYTES", "NODE", "ERROR",
                                                                    "LOCATION"))
    _emit(args, doc, text)
    return 0 if doc["restorable"] else 1


def _node_cell(shard: dict) -> str:
    if not shard["node"]:
        return "-"
    return shard["node"] + (" (unreachable)" if shard.get("reachable") is False else "")


def cmd_resume(args: argparse.Namespace) -> int:
    try:
        with reader(args, write=True) as rd:  # the oracle: the daemon's (--ckptd-url, $CKPTD_URL) or in-process
            doc = rd.resume(args.run, args)
            hardlinks = rd.allow_hardlinks() if args.repair_tracker or args.dry_run else False
    except NoAnswer as err:
        if args.json:
            _emit(args, {"detail": err.detail}, "")
            return 1
        for item in err.detail.get("skipped") or []:
            print(f"skipped step {item['step']}: {item['reason']}", file=sys.stderr)
        raise
    lines = [f"resume run {doc['run']} at step {doc['step']} (epoch {doc['epoch']}, {len(doc['shards'])} shards)",
             f"strategy: {doc['strategy_file'] or '-'}"]
    if doc.get("tier", "file") != "file":
        lines.append(f"tier: {doc['tier']}" + (f" (manifest {doc['manifest']}; `ckptd fetch --run {doc['run']} "
                                                  f"--step {doc['step']}` downloads it)" if doc.get("manifest") else ""))
    if doc.get("reason"):
        lines.append(f"NOTE: {doc['reason']}")  # e.g. "layout unchecked: …": restorable, not fully proven
    if doc.get("incarnation"):
        lines.append(f"incarnation: {doc['incarnation']} (restart {doc['incarnation']} into the same directory)")
    if doc.get("unreachable_nodes"):
        lines.append(f"WARNING: shards on unreachable node(s) {', '.join(doc['unreachable_nodes'])} (daemon silent); "
                     "--exclude-unreachable answers the newest step without them")
    lines += [f"  rank {x['rank']}: {x['path']}" + (f" [{x['node']}]" if x.get("node") else "")
              + ("" if x.get("own_file", True) else " (replica: no file of its own)")
              + (f" + {len(x['load_from']) - 1} more file(s)" if len(x.get("load_from", ())) > 1 else "")
              for x in doc["shards"]]
    mf = doc.get("mindformers")
    if mf:
        lines += [f"mindformers: load_checkpoint: {mf['load_checkpoint']}",
                  f"mindformers: resume_training: {mf['resume_training']}"]
        if not mf["loadable_by_mindformers"]:
            lines.append("mindformers: some ranks have no file of their own: MindFormers' loader cannot load this "
                         "step as is; load each rank from shards[].load_from (--json)")
        if mf.get("tracker"):
            lines.append(f"mindformers: tracker {mf['tracker']['path']}: {mf['tracker']['note']}")
    if args.repair_tracker or args.dry_run:
        doc["tracker_repair"] = _repair_tracker(args, doc, hardlinks)
        lines.append(_repair_line(doc["tracker_repair"]))
    lines += [f"skipped step {x['step']}: {x['reason']}" for x in doc["skipped"]]
    if doc["conversion"]:
        lines.append(f"conversion needed: world size {doc['conversion']['from_world_size']} -> {doc['conversion']['to_world_size']}")
    _emit(args, doc, "\n".join(lines))
    return 0


def _repair_tracker(args: argparse.Namespace, doc: dict, hardlinks: bool) -> dict:
    from ckptd import runlayout
    from ckptd.service import tracker
    from ckptd.storage import PosixStorage

    layout = doc.get("layout")
    if not (runlayout.known(layout) and runlayout.by_name(layout).has_tracker):
        raise CkptdError(f"run {doc['run']!r} is not a Checkpoint 2.0 run (layout {doc.get('layout')}): it has no tracker",
                         hint="--repair-tracker applies to MindFormers runs with iteration_<it>/ directories")
    run_path = os.path.dirname(doc["mindformers"]["checkpoint_dir"])
    # the answer is a verified iteration by construction: the oracle only answers verified steps;
    # the run's own directory bounds what may be written (it is <root>/<run> in the catalog)
    store = PosixStorage(os.path.dirname(run_path), hardlinks)
    return tracker.repair(store, run_path, doc["name_step"], verified=True, dry_run=args.dry_run)


def _repair_line(rep: dict) -> str:
    before = rep["before"] if rep["before"] is not None else rep["before_problem"]
    if rep["before"] == rep["after"]:
        return f"tracker {rep['path']}: already names iteration {rep['after']}, nothing written"
    verb = "would rewrite" if rep["dry_run"] else "rewrote"
    return f"tracker {rep['path']}: {verb} {before} -> {rep['after']} (temp file, fsync, rename, fsync dir)"


def cmd_gc(args: argparse.Namespace) -> int:
    from ckptd.policy import RetentionPolicy
    from ckptd.service.retention import gc

    from ckptd.cli import progress

    settings, sessions = catalog_sessions(args)
    from ckptd.catalog.nodes import NodeView

    owner = NodeView(sessions, settings.node_name, settings.node_timeout).owner()  # this machine deletes its own files
    with progress.bar(args, "gc: steps deleted", "step") as bar:
        report = gc(sessions, settings.storage, RetentionPolicy(args.keep_last, args.keep_every), owner=owner,
                    run_name=args.run, dry_run=args.dry_run, torn_grace=settings.gc_torn_grace, progress=bar)
    doc = report.to_dict()
    lines = []
    for plan in doc["runs"]:
        lines.append(f"run {plan['run']}: delete {plan['delete'] or 'nothing'}")
        lines += [f"  keep {step}: {why}" for step, why in plan["keep"].items()]
    lines += [f"{'would remove' if args.dry_run else 'removed'} torn temp file {p}" for p in doc["torn_temps"]]
    if not args.dry_run:
        lines.append(f"deleted {doc['deleted_steps']} steps ({doc['deleted_files']} files)")
    lines += [f"REFUSED {x}" for x in doc["refused"]]
    _emit(args, doc, "\n".join(lines) if lines else "no runs")
    return 1 if doc["refused"] else 0


def cmd_mark(args: argparse.Namespace) -> int:
    from ckptd.service import catalog

    _, sessions = catalog_sessions(args)
    with sessions.begin() as s:
        if args.action in ("mark-bad", "unmark-bad"):
            doc = catalog.mark_bad(s, args.run, args.step, getattr(args, "reason", None), bad=args.action == "mark-bad")
        else:
            doc = catalog.pin(s, args.run, args.step, args.action == "pin")
    _emit(args, doc, f"run {args.run} step {args.step}: marked_bad={doc['marked_bad']} pinned={doc['pinned']}")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    json.dump(settings.public_dict(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def cmd_verify_run(args: argparse.Namespace) -> int:
    """``ckptd verify --run R [--step S]``: re-verify catalogued shards now, with a progress bar."""
    from ckptd.cli import progress
    from ckptd.cli.files import rate_text
    from ckptd.catalog.nodes import NodeView
    from ckptd import daemon
    from ckptd.service.jobs import reverify, select_shards

    settings, sessions = catalog_sessions(args)
    settings = settings_from(args).model_copy(update={"db": settings.db, "root": settings.root})
    nodes = NodeView(sessions, settings.node_name, settings.node_timeout, root=str(settings.root))
    verifier = daemon.verifier(settings, sessions, nodes, pool=False)  # on this thread: the command starts no workers
    ingestor = daemon.ingestor(settings, sessions, nodes, lambda _ids, **_how: None, lambda _id: None)
    with sessions() as s:
        _, shards = select_shards(s, args.run, args.step)

    t0 = time.perf_counter()
    with progress.bar(args, f"verify {args.run}", "shard", len(shards)) as bar:
        result = reverify(sessions, ingestor.examine_many, verifier.verify_shards, verifier.check_step, shards, bar,
                          owner=verifier.nodes.owner)
    seconds = time.perf_counter() - t0
    result = {**result, "bytes_verified": verifier.verified_bytes, "seconds": round(seconds, 6),
              "bytes_per_second": round(verifier.verified_bytes / seconds) if seconds > 0 else None}
    bad = {k: v for k, v in result["shards"].items() if k != "verified"}
    text = [f"{len(shards)} shards: " + ", ".join(f"{v} {k}" for k, v in sorted(result["shards"].items()))
            + f"; {rate_text(verifier.verified_bytes, seconds)}"]
    text += [f"step {step}: {p}" for step, probs in result["step_problems"].items() for p in probs]
    _emit(args, result, "\n".join(text))
    return 0 if not bad and not result["step_problems"] else 1
