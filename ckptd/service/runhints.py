"""What a MindFormers job says about its own checkpoints: hints, never evidence.

* ``health_ckpts.json`` (rank 0, ``use_checkpoint_health_monitor``): a JSON list of
  ``{"is_health": flag, "ckpt_name": <rank 0's file name>}``. The key is inverted: 1 = abnormal
  (the embedding local norm crossed its threshold), 0 = healthy. MindFormers rewrites it with
  ``open('w')``, so a torn or half-written file is read as "no records" (the next save rewrites it).
* ``meta.json`` is never read for decisions: it lags async saves and is overwritten by a restart
  (see ``ckptd.runlayout``); the catalog is built from the files themselves.

Files are read through :mod:`ckptd.storage` (no symlinks, no FIFOs or devices, bounded size).
"""

from __future__ import annotations

import json
import logging
import os
import zlib

from ckptd import runlayout
from ckptd.catalog.models import Checkpoint, Run
from ckptd.format.limits import MAX_JSON_DEPTH, json_too_deep
from ckptd.storage import ConfinementError, PosixStorage

MAX_HINT_BYTES = 16 << 20  # a health record is ~60 bytes per save
log = logging.getLogger("ckptd.ingest")
_ignored: dict[str, int] = {}  # path -> checksum of the content last logged as ignored (logged once)


def read_health(store: PosixStorage, path: str) -> dict[str, bool]:
    """``{rank-0 file name: abnormal}`` from a ``health_ckpts.json`` (later records win)."""
    try:
        raw = store.read(path, MAX_HINT_BYTES)
    except (OSError, ConfinementError):
        return {}
    if json_too_deep(raw):  # MindFormers writes a flat list; Python's parser would recurse per level
        _ignore(path, raw, f"nests deeper than {MAX_JSON_DEPTH} levels")
        return {}
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}  # torn: the next save rewrites it (see the module docstring)
    out: dict[str, bool] = {}
    for rec in doc if isinstance(doc, list) else []:
        if isinstance(rec, dict) and isinstance(rec.get("ckpt_name"), str) and rec.get("is_health") in (0, 1):
            out[os.path.basename(rec["ckpt_name"])] = rec["is_health"] == 1
    return out


def _ignore(path: str, raw: bytes, why: str) -> None:
    crc = zlib.crc32(raw)
    if _ignored.get(path) != crc:  # once per content, not at every rescan
        if len(_ignored) > 4096:
            _ignored.clear()
        _ignored[path] = crc
        log.warning("health records %s ignored: %s", path, why)


ABNORMAL_REASON = "health_ckpts.json: is_health=1 (MindFormers' health monitor flags this save as abnormal)"


def apply_health(store: PosixStorage, run: Run, steps: list[Checkpoint]) -> None:
    """Set or clear ``health_reason`` of ``steps`` (loaded, locked by the caller) from the run's
    ``health_ckpts.json``; a record names rank 0's file of a save."""
    records = read_health(store, runlayout.health_path(os.path.join(store.root, run.name)))
    abnormal = set()
    for file_name, bad in records.items():
        parsed = runlayout.parse_shard_name(file_name, 0)
        if parsed is not None and bad:
            abnormal.add(parsed[:4])  # (prefix, epoch, step, breakpoint)
    for ckpt in steps:
        reason = ABNORMAL_REASON if (ckpt.prefix, ckpt.epoch, ckpt.step, ckpt.kind == "breakpoint") in abnormal else None
        if ckpt.health_reason != reason:
            ckpt.health_reason = reason
