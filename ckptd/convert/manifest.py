"""A written set's commit record: ``ckptd-manifest.json``, written last.

A conversion's output is a *set*: one file per destination rank (``rank_<r>/<prefix><r>.<ext>``)
and, when it has a target layout, its strategy file. The set is committed by this manifest, in the
manner of PyTorch DCP's ``.metadata``: every file is written under the conversion's temp tree,
verified, fsynced and renamed into the output directory first; the manifest is then written
atomically (temp, fsync, rename, fsync the directory) and its rename is the commit. Rank
directories without a manifest naming them are an unfinished set, never a copy.

The manifest holds each file's size and xxh3-128 (the digest the catalog keeps of every file),
taken while the file was written (:meth:`ckptd.convert.writers.OutFile.digest`), so whoever
catalogues the set reads this one small file, never the output again.

Format (version 1), UTF-8 JSON::

    {"format": "ckptd-written-set", "version": 1,
     "out_format": "ckpt" | "safetensors", "encrypted": bool,
     "src_strategy_hash": str | null, "dst_strategy_hash": str | null,
     "files": [{"path": "rank_0/checkpoint_0.ckpt", "rank": 0, "size": int, "xxh3_128": "<32 hex>"},
               {"path": "strategy.ckpt", "rank": null, ...}]}

``path`` is relative to the set's directory, a plain relative name (no ``..``, no leading ``/``).
A conversion of some ranks into a directory that holds a committed set of others keeps their
entries (:meth:`Manifest.merged`): the manifest always describes every rank directory it commits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ckptd.errors import CorruptError

MANIFEST_NAME = "ckptd-manifest.json"
FORMAT = "ckptd-written-set"
VERSION = 1
#: far above any real set (a 100,000-rank conversion's manifest is ~12 MB), far below a memory risk
MAX_MANIFEST_BYTES = 64 << 20
_HEX128 = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class ManifestFile:
    path: str  # relative to the set's directory
    rank: int | None  # None: the set's strategy file
    size: int
    xxh3_128: str


@dataclass(frozen=True, slots=True)
class Manifest:
    files: tuple[ManifestFile, ...]
    out_format: str
    encrypted: bool
    src_strategy_hash: str | None
    dst_strategy_hash: str | None

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "version": VERSION, "out_format": self.out_format, "encrypted": self.encrypted,
               "src_strategy_hash": self.src_strategy_hash, "dst_strategy_hash": self.dst_strategy_hash,
               "files": [{"path": f.path, "rank": f.rank, "size": f.size, "xxh3_128": f.xxh3_128}
                         for f in sorted(self.files, key=lambda f: (f.rank is None, f.rank or 0, f.path))]}
        return json.dumps(doc, indent=1).encode() + b"\n"

    def merged(self, earlier: Manifest | None) -> Manifest:
        """This set plus the rank files of ``earlier`` (a committed set in the same directory) that
        this one did not write: the same layout and format only, else this set alone."""
        if earlier is None or (earlier.dst_strategy_hash, earlier.out_format, earlier.encrypted) != \
                (self.dst_strategy_hash, self.out_format, self.encrypted):
            return self
        mine = {f.path for f in self.files} | {f.rank for f in self.files if f.rank is not None}
        kept = tuple(f for f in earlier.files if f.path not in mine and f.rank is not None and f.rank not in mine)
        return Manifest(self.files + kept, self.out_format, self.encrypted, self.src_strategy_hash,
                        self.dst_strategy_hash)

    def rank_files(self) -> dict[int, ManifestFile]:
        return {f.rank: f for f in self.files if f.rank is not None}


def parse_manifest(data: bytes, where: str) -> Manifest:
    """A manifest's bytes, checked field by field (:class:`CorruptError` naming what is wrong)."""
    def bad(what: str) -> CorruptError:
        return CorruptError(f"not a ckptd manifest: {what}", path=where,
                            hint="it was not written by ckptd, or was damaged: convert the step again into a new directory")

    if len(data) > MAX_MANIFEST_BYTES:
        raise bad(f"{len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise bad("not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad(f"format is not {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise bad(f"version {doc.get('version')!r}, this ckptd reads {VERSION}")
    files = doc.get("files")
    if not isinstance(files, list):
        raise bad("files is not a list")
    out: list[ManifestFile] = []
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            raise bad(f"files[{i}] is not an object")
        path, rank, size, digest = f.get("path"), f.get("rank"), f.get("size"), f.get("xxh3_128")
        if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
            raise bad(f"files[{i}].path {path!r} is not a plain relative name")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise bad(f"files[{i}].rank {rank!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"files[{i}].size {size!r}")
        if not isinstance(digest, str) or not _HEX128.fullmatch(digest):
            raise bad(f"files[{i}].xxh3_128 is not 32 hex digits")
        out.append(ManifestFile(path, rank, size, digest))
    fmt, enc = doc.get("out_format"), doc.get("encrypted")
    if fmt not in ("ckpt", "safetensors") or not isinstance(enc, bool):
        raise bad("out_format/encrypted")
    src, dst = doc.get("src_strategy_hash"), doc.get("dst_strategy_hash")
    if not all(h is None or isinstance(h, str) for h in (src, dst)):
        raise bad("strategy hashes")
    return Manifest(tuple(out), fmt, enc, src, dst)
