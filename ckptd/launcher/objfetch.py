"""Before a restart: a step answered from the object tier is downloaded into the run directory.

The oracle answers ``tier: object`` when a step's files are gone (a wiped root, a run moved to new
machines) but its objects are whole. Each shard's ``path`` in that answer is where its file belongs;
the launcher downloads the step there from its manifest (``manifest``: an ``s3://`` URI; endpoint and
credentials from the job's environment, as every S3 client reads them), every byte checked against
the manifest, so the restarted job loads files as after any other failure. ckptd's watcher then
catalogues and verifies them like any save.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def fetch_answer(body: dict, run_dir: str, log: Callable[..., None], attempt: int) -> None:
    """Download the answered step into ``run_dir`` (raises :class:`ckptd.errors.CkptdError` on failure)."""
    from ckptd.storage import objmanifest
    from ckptd.storage.s3 import ObjectStore, ObjectStoreError

    uri = body.get("manifest")
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ObjectStoreError("an object-tier answer without a manifest URI", kind="other")
    bucket, _, key = uri[5:].partition("/")
    store = ObjectStore(f"s3://{bucket}")
    t = time.monotonic()
    try:
        doc = objmanifest.fetch_step(store, key, run_dir)
    finally:
        store.close()
    log(attempt=attempt, event="fetched", step=body.get("step"), objects=len(doc["objects"]),
        bytes=sum(o["size"] for o in doc["objects"]), seconds=f"{time.monotonic() - t:.1f}",
        reason=f"the step's files were gone: downloaded from {uri} and checked against its manifest")
