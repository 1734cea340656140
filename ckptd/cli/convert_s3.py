"""``ckptd convert --src s3://BUCKET/PREFIX/RUN/STEP``: a step on the object tier as a conversion's source.

The converter reads sources through memory maps of confined files (``ckptd.convert.sources``), so an
object-tier step is first fetched -- every object checked against the step's manifest, as ``ckptd
fetch`` does -- into a hidden temporary directory next to ``--out`` (the destination's filesystem:
the bytes are about to be written there anyway), converted from there as the run directory it was,
and the temporary copy is removed afterwards, whatever the outcome. The source strategy is the
step's own from the manifest unless ``--src-strategy`` names one: the run's ``strategy.ckpt``, or
the directory of MindFormers' per-rank ``strategy/ckpt_strategy_rank_<r>.ckpt`` files.

The URL is the step's directory on the tier (``PREFIX/<run>/<step>``, ``<step>-i<k>`` for a
restarted job's save of a step seen before), or its manifest's URL.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptd.errors import CkptdError

#: the temporary copies' names: hidden, so the watcher and listings of a checkpoint root skip them
TEMP_PREFIX = ".ckptd-s3src-"


@dataclass(frozen=True)
class FetchedStep:
    src: str  # what --src becomes: the fetched run directory (a Checkpoint 2.0 step: its iteration directory)
    strategy: str | None  # the step's strategy file or per-rank directory, fetched (None: the step has none)
    iteration: bool  # a Checkpoint 2.0 iteration: its metadata.json is the source layout
    manifest: dict[str, Any]


def is_object_url(src: str | None) -> bool:
    return bool(src) and src.startswith("s3://")


def manifest_location(url: str) -> tuple[str, str]:
    """``(s3://BUCKET, manifest key)`` of a step's URL (its directory or its manifest)."""
    from ckptd.storage import objmanifest
    from ckptd.storage.s3 import parse_url, safe_relative

    bucket, _, key = url[len("s3://"):].partition("/")
    key = key.strip("/")
    if key.endswith("/" + objmanifest.MANIFEST_NAME):
        key = key[:-len(objmanifest.MANIFEST_NAME) - 1]
    if not key or not safe_relative(key):
        raise CkptdError(f"--src {url!r} does not name a step on the object tier",
                         hint="give s3://BUCKET/PREFIX/RUN/STEP, the step's directory (its manifest is "
                              f"{objmanifest.MANIFEST_NAME} there)")
    return str(parse_url(f"s3://{bucket}")), f"{key}/{objmanifest.MANIFEST_NAME}"


def strategy_of(objects: list[dict[str, Any]]) -> str | None:
    """The run-relative path of the step's strategy: its one file (native ``strategy.ckpt``), or the
    directory of its per-rank files (MindFormers' ``strategy/``)."""
    paths = sorted(o["path"] for o in objects if o.get("role") == "strategy")
    if not paths:
        return None
    dirs = {posixpath.dirname(p) for p in paths}
    if len(dirs) == 1 and (d := dirs.pop()):
        return d
    if len(paths) == 1:
        return paths[0]
    raise CkptdError(f"the step's manifest names strategy files in several places ({', '.join(paths[:4])})",
                     hint="fetch the step (ckptd fetch) and pass --src-strategy")


@contextlib.contextmanager
def fetched(url: str, out: str, progress: Callable[[int, int], None] | None = None) -> Iterator[FetchedStep]:
    """The step at ``url`` fetched next to ``out`` (checked against its manifest); removed on exit."""
    from ckptd import runlayout
    from ckptd.storage import PosixStorage, objmanifest
    from ckptd.storage.s3 import ObjectStore

    store_url, key = manifest_location(url)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)  # the operator's own output path, as the converter treats --out
    store = ObjectStore(store_url)
    temp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
    try:
        state = {"done": 0, "total": 0}

        def total(n: int) -> None:
            state["total"] = n

        def moved(n: int) -> None:
            state["done"] += n
            if progress is not None:
                progress(state["done"], state["total"])

        run_dir = os.path.join(temp, "run")
        doc = objmanifest.fetch_step(store, key, PosixStorage(temp), run_dir, progress=moved, total=total)
        src, iteration = run_dir, runlayout.known(doc.get("layout")) and runlayout.by_name(doc["layout"]).iterations
        if iteration:  # a Checkpoint 2.0 step is one iteration directory: the converter reads that
            src = os.path.join(run_dir, *posixpath.dirname(
                next(o["path"] for o in doc["objects"] if o.get("role") != "strategy")).split("/"))
        rel = strategy_of(doc["objects"])
        yield FetchedStep(src, os.path.join(run_dir, *rel.split("/")) if rel else None, iteration, doc)
    finally:
        store.close()
        PosixStorage(parent).remove_tree(temp)
