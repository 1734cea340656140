"""Atomic file creation: write to a temp name, fsync, rename into place, fsync the directory.

A crash at any point leaves either the old state or the complete new file, never a torn file
under the final name. Temp files use a ``.ckptd-tmp`` suffix so watchers can ignore them.
"""

from __future__ import annotations

import contextlib
import os
from typing import BinaryIO, Iterator

TMP_SUFFIX = ".ckptd-tmp"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, overwrite: bool = False, mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a binary file; on clean exit it becomes ``path`` atomically, on error it vanishes.

    Refuses to replace an existing file unless ``overwrite`` (losing a checkpoint by accident is
    worse than an error).
    """
    final = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(final)
    if not overwrite and os.path.lexists(final):
        from ckptd.errors import CkptdError

        raise CkptdError("refusing to overwrite an existing file", path=final, hint="choose another output path")
    tmp = f"{final}.{os.getpid()}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    ok = False
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, final)
        else:
            # link+unlink would also refuse races, but rename keeps this portable; the lexists
            # check above is the guard against operator mistakes, not concurrent writers.
            os.rename(tmp, final)
        fsync_dir(directory)
        ok = True
    finally:
        if not ok:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
