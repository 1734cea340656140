"""Confinement: every file ckptd opens under the checkpoint root is opened through here.

Any job can write into the root, and ckptd often runs as root, so a path from the root is hostile
until proven otherwise. :func:`open_beneath` resolves a path one component at a time from the
root's own directory descriptor with ``O_NOFOLLOW`` — a symlink anywhere (a file, a ``strategy/``
or ``converted/`` directory pointing elsewhere) is refused, not followed — checks the final name
with ``lstat`` before opening (a device node is never opened: opening some acts), opens it
``O_NONBLOCK`` (a FIFO planted under a checkpoint name must not block a thread forever) and
``fstat``s the descriptor it got (the name may have been swapped meanwhile). Only regular files
pass. Because every step works on descriptors, nothing can be swapped between the check and
the use.

Writes go through :func:`make_dirs_beneath`, which creates missing directories from the root's
descriptor in the same way, so an output directory can never be redirected outside the root.
Deletions go through :func:`unlink_beneath`, :func:`rmdir_beneath` and :func:`rmtree_beneath`:
they act on a name inside the directory descriptor reached that way, so a symlinked rank or
``converted/`` directory can never make retention delete another run's (or anyone's) files.

The format readers (``ckptd.format``) open files by name; the service hands them
``/proc/self/fd/<n>`` of a descriptor opened here (:func:`proc_path`), which reopens exactly the
inode that passed, never a name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator

from ckptd.errors import CkptdError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


class ConfinementError(CkptdError):
    code = "confinement"
    default_hint = ("ckptd only reads and writes regular files and real directories inside its checkpoint root; "
                    "remove the symlink or special file")


def _components(root: str, path: str) -> list[str]:
    root_abs = os.path.abspath(root)
    prefix = root_abs.rstrip(os.sep) + os.sep
    if path.startswith(prefix):  # the usual case, a plain absolute path below the root: nothing to normalise
        parts = path[len(prefix):].split(os.sep)
        if all(p not in ("", os.curdir, os.pardir) for p in parts):
            return parts
    rel = os.path.relpath(os.path.abspath(path), root_abs)
    if rel == os.curdir or rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise ConfinementError("outside the checkpoint root", path=path)
    parts = rel.split(os.sep)
    if any(p in ("", os.curdir, os.pardir) for p in parts):
        raise ConfinementError("not a plain path below the checkpoint root", path=path)
    return parts


def _open_dir(name: str, dir_fd: int | None, path: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConfinementError(f"{name!r} is a symlink or not a directory", path=path) from None
        raise


def _open_root(root: str) -> int:
    # the root itself may be a symlink (an operator's mount choice); nothing below it may
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)


@contextlib.contextmanager
def _walk(root: str, parts: list[str], path: str, create: bool = False) -> Iterator[int]:
    """A descriptor of the directory holding ``parts[-1]`` (each component a real directory)."""
    fd = _open_root(root)
    try:
        for name in parts[:-1]:
            try:
                nfd = _open_dir(name, fd, path)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                nfd = _open_dir(name, fd, path)
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def open_beneath(root: str, path: str) -> int:
    """A read-only descriptor of the regular file ``path`` below ``root`` (see module docstring).
    Raises :class:`ConfinementError` for symlinks, special files and escapes, and the usual
    ``FileNotFoundError`` when it is not there."""
    parts = _components(root, path)
    with _walk(root, parts, path) as dir_fd:
        st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise ConfinementError(f"not a regular file ({kind_of(st.st_mode)})", path=path)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise ConfinementError("became a symlink", path=path) from None
            raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfinementError(f"not a regular file ({kind_of(st.st_mode)})", path=path)
    return fd


def read_beneath(root: str, path: str, limit: int) -> bytes:
    """The bytes of a regular file below ``root``, at most ``limit`` (more is an error)."""
    return read_with_stat(root, path, limit)[0]


def read_with_stat(root: str, path: str, limit: int) -> tuple[bytes, os.stat_result]:
    """:func:`read_beneath` and the ``fstat`` of the very file read."""
    fd = open_beneath(root, path)
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size > limit:
            raise ConfinementError(f"{size} bytes is more than the {limit} ckptd reads from such a file", path=path,
                                   hint="this is not a file the trainer writes; remove it")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise ConfinementError(f"grew past {limit} bytes while being read", path=path)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def proc_path(fd: int) -> str:
    """A name that reopens exactly this descriptor's file (Linux), for readers that take names."""
    return f"/proc/self/fd/{fd}"


@contextlib.contextmanager
def opened(root: str, path: str) -> Iterator[str]:
    """``with opened(root, path) as name:`` — ``name`` reopens the confined file itself."""
    fd = open_beneath(root, path)
    try:
        yield proc_path(fd)
    finally:
        os.close(fd)


def make_dirs_beneath(root: str, path: str) -> None:
    """``mkdir -p path`` below ``root``, every existing component a real directory (no symlink)."""
    parts = _components(root, path) + ["."]
    with _walk(root, parts, path, create=True):
        pass


def check_dir_beneath(root: str, path: str) -> None:
    """Raise unless every existing component of ``path`` below ``root`` is a real directory."""
    parts = _components(root, path)
    fd = _open_root(root)
    try:
        for name in parts:
            try:
                nfd = _open_dir(name, fd, path)
            except FileNotFoundError:
                return
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


def is_regular_beneath(root: str, path: str) -> bool:
    """True if ``path`` is a regular file reached without symlinks below ``root`` (no exceptions)."""
    try:
        os.close(open_beneath(root, path))
        return True
    except (ConfinementError, OSError):
        return False


def unlink_beneath(root: str, path: str) -> None:
    """Remove the file ``path`` below ``root``: every directory component a real directory, the
    name itself not a symlink (retention deletes what the catalog recorded, never what a link
    points at, nor the link: a planted link is for an operator to look at)."""
    parts = _components(root, path)
    with _walk(root, parts, path) as dir_fd:
        st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):
            raise ConfinementError(f"is a {kind_of(st.st_mode)}, not a file ckptd wrote", path=path)
        os.unlink(parts[-1], dir_fd=dir_fd)


def rmdir_beneath(root: str, path: str) -> None:
    """``rmdir`` of an empty real directory below ``root`` (OSError if not empty)."""
    parts = _components(root, path)
    with _walk(root, parts, path) as dir_fd:
        os.close(_open_dir(parts[-1], dir_fd, path))  # refuses a symlink in its place
        os.rmdir(parts[-1], dir_fd=dir_fd)


def listdir_beneath(root: str, path: str) -> list[str]:
    """The names in the real directory ``path`` below ``root``, every component a real directory."""
    parts = _components(root, path)
    with _walk(root, parts, path) as dir_fd:
        fd = _open_dir(parts[-1], dir_fd, path)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def rmtree_beneath(root: str, path: str) -> None:
    """``rm -r`` of the real directory ``path`` below ``root``. shutil's descriptor-based rmtree
    (``dir_fd``) never follows a symlink inside the tree; a symlink as ``path`` itself is refused."""
    parts = _components(root, path)
    with _walk(root, parts, path) as dir_fd:
        os.close(_open_dir(parts[-1], dir_fd, path))
        if not shutil.rmtree.avoids_symlink_attacks:  # only the fd-based implementation is safe here
            raise ConfinementError("this platform's rmtree may follow symlinks; not deleted", path=path)
        shutil.rmtree(parts[-1], dir_fd=dir_fd)


def kind_of(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words (for reasons and logs)."""
    for test, name in ((stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"
