"""``ckptd fetch --run R --step S [--to DIR]``: a step downloaded from the object tier, checked.

Reads the step's manifest (``object_store`` from the flag, ``CKPTD_OBJECT_STORE`` or the config
file; endpoint and credentials from the S3 environment), refuses one naming a path outside the run,
and downloads every object with parallel ranged GETs into ``DIR`` (default: the run's directory
under the checkpoint root), each file written through ``PosixStorage`` (confined, atomic) and
checked against the manifest's size and xxh3-128 before it is renamed in. The catalog is not
needed: this works on a machine that has only the bucket.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("fetch", help="download a step from the object tier (checked against its manifest)")
    p.add_argument("--run", required=True, help="run name")
    p.add_argument("--step", required=True, type=int, help="the step (its global step)")
    p.add_argument("--incarnation", type=int, default=None, help="a restarted job's save of a step number seen before")
    p.add_argument("--to", metavar="DIR", help="run directory to write (default: <root>/<run>)")
    p.add_argument("--object-store", metavar="s3://BUCKET/PREFIX", help="default: object_store of the configuration")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=cmd_fetch)


def cmd_fetch(args: argparse.Namespace) -> int:
    from ckptd.cli import progress
    from ckptd.errors import CkptdError
    from ckptd.settings import Settings
    from ckptd.storage import PosixStorage, objmanifest
    from ckptd.storage.s3 import ObjectStore

    if "/" in args.run or args.run in ("", ".", "..") or args.run.startswith("."):
        raise CkptdError(f"{args.run!r} is not a run name", hint="a run is one directory name under the root")
    settings = Settings(**({"object_store": args.object_store} if args.object_store else {}))
    if settings.object_store is None:
        raise CkptdError("no object store configured", hint="pass --object-store s3://BUCKET/PREFIX or set object_store")
    if args.to:  # the operator's own directory: a symlink on the way there is their choice
        dest = os.path.abspath(args.to)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        files = PosixStorage(os.path.dirname(dest))
    else:
        dest, files = os.path.join(str(settings.root), args.run), settings.storage
    store = ObjectStore(settings.object_store)
    key = objmanifest.manifest_key(args.run, args.step, args.incarnation)
    try:
        with progress.bar(args, f"fetch {args.run} step {args.step}", unit="B", scale=True) as bar:
            state = {"done": 0, "total": 0}

            def total(n: int) -> None:
                state["total"] = n
                bar(0, n)

            def moved(n: int) -> None:
                state["done"] += n
                bar(state["done"], state["total"])

            doc = objmanifest.fetch_step(store, key, files, dest, progress=moved, total=total)
    finally:
        store.close()
    result = {"run": args.run, "step": args.step, "to": dest, "manifest": store.uri(key),
              "files": [o["path"] for o in doc["objects"]], "bytes": sum(o["size"] for o in doc["objects"])}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"fetched run {args.run} step {args.step}: {len(result['files'])} files, {result['bytes']} bytes "
              f"into {dest} (every byte checked against {result['manifest']})")
    return 0
