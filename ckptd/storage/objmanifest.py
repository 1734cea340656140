"""A step's manifest on the object tier: the commit record, written after every object it names.

``PREFIX/<run>/<step>/ckptd-manifest.json`` lists every object of the step by its run-relative path
(the shards' and the strategy file's), with size and xxh3-128, the step's identity and the layout.
A step without one is not on the tier. Reading one trusts nothing: it is bounded in size, every
field is type-checked, and a path that could leave the run (absolute, ``..``, empty components) is
refused before anything is downloaded. :func:`fetch_step` restores a step from it into a run
directory through :class:`~ckptd.storage.posix.PosixStorage` (each file downloaded with parallel
ranged GETs into a confined temp name, hashed, renamed in only when whole).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from ckptd.errors import CkptdError
from ckptd.storage.posix import PosixStorage
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


def fetch_step(objects: ObjectStore, key: str, files: PosixStorage, run_dir: str, *,
               progress: Callable[[int], None] | None = None,
               total: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Download the step whose manifest is ``key`` into ``run_dir``, a directory below ``files``'
    root (created, confined like every write there: no symlink on the way is followed). Each file
    goes through :meth:`PosixStorage.create` -- a temp name, fsynced, renamed in only once its
    bytes are the manifest's -- so a torn or wrong download never sits under a shard's name. A file
    already there with the manifest's size and digest is kept. Returns the manifest."""
    doc = read(objects, key)
    base = key.rsplit("/", 1)[0]
    if total is not None:
        total(sum(o["size"] for o in doc["objects"]))
    # the strategy file first: a shard newer than its strategy file is how a re-save is told apart
    for o in sorted(doc["objects"], key=lambda o: (o.get("role") != "strategy", o["path"])):
        dest = os.path.join(run_dir, *o["path"].split("/"))
        if _holds(files, dest, o["size"], o["xxh3_128"]):
            if progress is not None:
                progress(o["size"])
            continue
        try:
            with files.create(dest, overwrite=True) as out:
                objects.download(f"{base}/{o['path']}", out, o["size"], o["xxh3_128"], progress)
        except OSError as exc:
            raise CkptdError(f"cannot write the fetched file: {exc.strerror or exc}", path=dest,
                             hint="make the run directory writable (and nothing but a file in that place)") from None
    return doc


def _holds(files: PosixStorage, path: str, size: int, digest: str) -> bool:
    """The regular file at ``path`` is already this object (read confined; anything else is replaced)."""
    import xxhash

    st = files.stat(path)
    if st is None or st.st_size != size:
        return False
    try:
        with files.opened(path) as name, open(name, "rb") as f:
            h = xxhash.xxh3_128()
            while chunk := f.read(8 << 20):
                h.update(chunk)
    except (CkptdError, OSError):
        return False
    return h.hexdigest() == digest
