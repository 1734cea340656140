"""A step's manifest on the object tier: the commit record, written after every object it names.

``PREFIX/<run>/<step>/ckptd-manifest.json`` lists every object of the step by its run-relative path
(the shards' and the strategy file's), with size and xxh3-128, the step's identity and the layout.
A step without one is not on the tier. Reading one trusts nothing: it is bounded in size, every
field is type-checked, and a path that could leave the run (absolute, ``..``, empty components) is
refused before anything is downloaded. :func:`fetch_step` restores a step from it into a run
directory (each file downloaded with parallel ranged GETs, hashed, renamed in only when whole).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from ckptd.storage.s3 import ObjectStore, ObjectStoreError, safe_relative

MANIFEST_NAME = "ckptd-manifest.json"
FORMAT = "ckptd.object-manifest"
MAX_MANIFEST = 16 << 20


class ManifestError(ObjectStoreError):
    code = "bad_manifest"
    default_hint = "the step's manifest is damaged or hostile: the step is not restored from the object tier"


def step_dir(run: str, step: int, incarnation: int | None) -> str:
    """``<run>/<step>`` (``<step>-i<k>`` for a restarted job's save of a step number seen before)."""
    return f"{run}/{step}" + (f"-i{incarnation}" if incarnation else "")


def manifest_key(run: str, step: int, incarnation: int | None) -> str:
    return f"{step_dir(run, step, incarnation)}/{MANIFEST_NAME}"


def encode(run: str, identity: dict[str, Any], layout: str, strategy_hash: str | None,
           objects: list[dict[str, Any]]) -> bytes:
    doc = {"format": FORMAT, "version": 1, "run": run, "step": identity, "layout": layout,
           "strategy_hash": strategy_hash, "objects": sorted(objects, key=lambda o: o["path"])}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def parse(data: bytes, where: str) -> dict[str, Any]:
    """A manifest's content checked; raises :class:`ManifestError` saying what is wrong."""
    try:
        doc = json.loads(data)
    except ValueError:
        raise ManifestError("the manifest is not JSON", path=where) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != 1:
        raise ManifestError(f"not a {FORMAT} version 1", path=where)
    objs = doc.get("objects")
    if not isinstance(objs, list) or not objs:
        raise ManifestError("the manifest names no objects", path=where)
    seen = set()
    for o in objs:
        if not isinstance(o, dict) or not isinstance(o.get("path"), str) or not isinstance(o.get("size"), int) \
                or o["size"] < 0 or not isinstance(o.get("xxh3_128"), str) or len(o["xxh3_128"]) != 32:
            raise ManifestError("an object entry lacks path, size or xxh3_128", path=where)
        if not safe_relative(o["path"]) or o["path"] == MANIFEST_NAME:
            raise ManifestError(f"the manifest names {o['path']!r}, a path outside the run: refused", path=where)
        if o["path"] in seen:
            raise ManifestError(f"the manifest names {o['path']!r} twice", path=where)
        seen.add(o["path"])
    return doc


def read(objects: ObjectStore, key: str) -> dict[str, Any]:
    return parse(objects.get_bytes(key, MAX_MANIFEST), objects.uri(key))


def fetch_step(objects: ObjectStore, key: str, run_dir: str, *, progress: Callable[[int], None] | None = None,
               total: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Download the step whose manifest is ``key`` into ``run_dir`` (created; files already there
    with the manifest's size are re-checked by hash and kept when equal). Every byte is checked
    against the manifest. Returns the manifest."""
    import xxhash

    doc = read(objects, key)
    base = key.rsplit("/", 1)[0]
    if total is not None:
        total(sum(o["size"] for o in doc["objects"]))
    # the strategy file first: a shard newer than its strategy file is how a re-save is told apart
    for o in sorted(doc["objects"], key=lambda o: (o.get("role") != "strategy", o["path"])):
        dest = os.path.join(run_dir, *o["path"].split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if os.path.isfile(dest) and not os.path.islink(dest) and os.path.getsize(dest) == o["size"]:
            with open(dest, "rb") as f:
                h = xxhash.xxh3_128()
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            if h.hexdigest() == o["xxh3_128"]:
                if progress is not None:
                    progress(o["size"])
                continue
        objects.get_file(f"{base}/{o['path']}", dest, o["size"], o["xxh3_128"], progress)
    return doc
