"""Atomic file creation: write to a temp name, fsync, rename into place, fsync the directory.

A crash at any point leaves either the old state or the complete new file, never a torn file
under the final name. Every step after opening the directory acts on its descriptor. Temp files use a ``.ckptd-tmp`` suffix so watchers can ignore them.
"""

from __future__ import annotations

import contextlib
import os
from typing import BinaryIO, Iterator

TMP_SUFFIX = ".ckptd-tmp"


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, overwrite: bool = False, mode: int = 0o644,
                 dir_fd: int | None = None) -> Iterator[BinaryIO]:
    """Yield a binary file; on clean exit it becomes ``path`` atomically, on error it vanishes.

    Refuses to replace an existing file unless ``overwrite`` (losing a checkpoint by accident is
    worse than an error). With ``dir_fd`` (a directory descriptor, e.g. from
    ``ckptd.storage.PosixStorage.open_dir``) ``path`` is a bare name in that directory and every step
    -- create, rename, fsync -- acts on the descriptor, so a directory swapped for a symlink
    meanwhile cannot redirect the write. The temp file is created ``O_NOFOLLOW``.
    """
    if dir_fd is None:
        final = os.path.abspath(os.fspath(path))
        directory, name = os.path.split(final)
        with contextlib.ExitStack() as stack:
            fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
            stack.callback(os.close, fd)
            with _write_at(fd, name, final, overwrite, mode) as fh:
                yield fh
        return
    name = os.fspath(path)
    if os.sep in name:
        raise ValueError(f"with dir_fd, {name!r} must be a bare file name")
    with _write_at(dir_fd, name, name, overwrite, mode) as fh:
        yield fh


@contextlib.contextmanager
def _write_at(dir_fd: int, name: str, shown: str, overwrite: bool, mode: int) -> Iterator[BinaryIO]:
    if not overwrite and _exists_at(dir_fd, name):
        from ckptd.errors import CkptdError

        raise CkptdError("refusing to overwrite an existing file", path=shown, hint="choose another output path")
    tmp = f"{name}.{os.getpid()}{TMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
    ok = False
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            # link+unlink would also refuse races, but rename keeps this portable; the exists
            # check above is the guard against operator mistakes, not concurrent writers.
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
        ok = True
    finally:
        if not ok:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)


def _exists_at(dir_fd: int, name: str) -> bool:
    """A name is there (a symlink counts: it is not followed, and not replaced)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
