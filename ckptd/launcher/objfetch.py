"""Before a restart: a step answered from the object tier is downloaded into the run directory.

The oracle answers ``tier: object`` when a step's files are gone (a wiped root, a run moved to new
machines) but its objects are whole. Each shard's ``path`` in that answer is where its file belongs;
the launcher downloads the step there from its manifest (``manifest``: an ``s3://`` URI; endpoint and
credentials from the job's environment, as every S3 client reads them), every byte checked against
the manifest, so the restarted job loads files as after any other failure. The files are written
through ``ckptd.storage.PosixStorage`` rooted at the run directory's parent: nothing below it is
followed through a symlink, and each file is a temp name renamed in only when whole. ckptd's
watcher then catalogues and verifies them like any save.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def fetch_answer(body: dict, run_dir: str, log: Callable[..., None], attempt: int) -> None:
    """Download the answered step into ``run_dir`` (raises :class:`ckptd.errors.CkptdError` on failure)."""
    from ckptd.storage import PosixStorage, objmanifest
    from ckptd.storage.s3 import ObjectStore, ObjectStoreError

    uri = body.get("manifest")
    if not isinstance(uri, str) or not uri.startswith("s3://") or not uri.endswith("/" + objmanifest.MANIFEST_NAME):
        raise ObjectStoreError("an object-tier answer without a manifest URI", kind="other")
    run_dir = os.path.abspath(run_dir)
    wanted = shard_paths(body, uri)
    bad = sorted(p for p in wanted.values() if not p.startswith(run_dir + os.sep))
    if bad:  # the job loads the answer's paths: files fetched anywhere else would not be found
        raise ObjectStoreError(f"ckptd answers the step's files at {bad[0]}, outside this launcher's run directory "
                               f"{run_dir}", kind="config",
                               hint="launch the job in the run directory ckptd catalogued (its --root and run name)")
    bucket, _, key = uri[5:].partition("/")
    store = ObjectStore(f"s3://{bucket}")
    t = time.monotonic()
    try:
        doc = objmanifest.fetch_step(store, key, PosixStorage(os.path.dirname(run_dir)), run_dir)
    finally:
        store.close()
    held = {os.path.join(run_dir, *o["path"].split("/")) for o in doc["objects"]}
    if missing := sorted(set(wanted.values()) - held):
        raise ObjectStoreError(f"the step's manifest {uri} holds no object for {missing[0]}, which ckptd's answer "
                               "names", kind="other")
    log(attempt=attempt, event="fetched", step=body.get("step"), objects=len(doc["objects"]),
        bytes=sum(o["size"] for o in doc["objects"]), seconds=f"{time.monotonic() - t:.1f}",
        reason=f"the step's files were gone: downloaded from {uri} and checked against its manifest")


def shard_paths(body: dict, manifest_uri: str) -> dict[int, str]:
    """rank -> the absolute path the answer puts that rank's file at (checked to be the same
    run-relative path as its object below the manifest's step directory)."""
    from ckptd.storage.s3 import ObjectStoreError

    base = manifest_uri.rsplit("/", 1)[0] + "/"
    out = {}
    for s in body.get("shards") or []:
        loc, path = s.get("location"), s.get("path")
        if not (isinstance(loc, str) and isinstance(path, str) and loc.startswith(base) and os.path.isabs(path)
                and path.endswith("/" + loc[len(base):])):
            raise ObjectStoreError(f"an object-tier answer's rank {s.get('rank')} does not name its object below "
                                   f"{base} and a file path ending the same way", kind="other")
        out[int(s["rank"])] = os.path.normpath(path)
    if not out:
        raise ObjectStoreError("an object-tier answer without shards", kind="other")
    return out
