"""What a MindFormers job says about its own checkpoints: hints, never evidence.

* ``health_ckpts.json`` (rank 0, ``use_checkpoint_health_monitor``): a JSON list of
  ``{"is_health": flag, "ckpt_name": <rank 0's file name>}``. The key is inverted: 1 = abnormal
  (the embedding local norm crossed its threshold), 0 = healthy. MindFormers rewrites it with
  ``open('w')``, so a torn or half-written file is read as "no records" (the next save rewrites it).
* ``meta.json`` is never read for decisions: it lags async saves and is overwritten by a restart
  (see ``ckptd.runlayout``); the catalog is built from the files themselves.

Files are opened without following symlinks and without blocking (a FIFO planted under the name
must not freeze the ingest thread), and only regular files of bounded size are read.
"""

from __future__ import annotations

import errno
import json
import os
import stat

MAX_HINT_BYTES = 16 << 20  # a health record is ~60 bytes per save


def read_small_file(path: str, limit: int = MAX_HINT_BYTES) -> bytes | None:
    """The bytes of a regular file no bigger than ``limit``; None for anything else (missing,
    symlink, FIFO, device, directory, too big, unreadable)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        if err.errno not in (errno.ENOENT, errno.ELOOP, errno.EACCES, errno.ENOTDIR):
            raise
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        data = os.read(fd, limit + 1)
        return data if len(data) <= limit else None
    finally:
        os.close(fd)


def read_health(path: str) -> dict[str, bool]:
    """``{rank-0 file name: abnormal}`` from a ``health_ckpts.json`` (later records win)."""
    raw = read_small_file(path)
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    out: dict[str, bool] = {}
    for rec in doc if isinstance(doc, list) else []:
        if isinstance(rec, dict) and isinstance(rec.get("ckpt_name"), str) and rec.get("is_health") in (0, 1):
            out[os.path.basename(rec["ckpt_name"])] = rec["is_health"] == 1
    return out


ABNORMAL_REASON = "health_ckpts.json: is_health=1 (MindFormers' health monitor flags this save as abnormal)"
