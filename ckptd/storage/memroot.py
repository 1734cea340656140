"""The memory root confined: every step below it by directory descriptor, never following a link.

The memory root is world-writable (1777, like ``/tmp``), so anyone on the node can plant a region,
a rank directory or a slot there, or swap one for a symbolic link between two looks at it. The
daemon (often root) therefore opens each level relative to the descriptor of the one above with
``O_NOFOLLOW``, checks what it opened (fstat of the descriptor, not of a path that may have been
swapped since), and removes a region by name under descriptors too: nothing outside the root is
read or removed, whatever the job's user does to its own region meanwhile.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from ckptd.storage.memslot import SlotError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
SLOT_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


@dataclass
class Region:
    """A run's region under the memory root, its directories held open for one scan."""

    key: str
    uid: int  # its owner: every rank directory and slot in it must be theirs
    fds: list[int]
    slots: list[tuple[int, int, str, str]]  # (rank, rank directory's descriptor, slot name, path)
    failed: bool = False  # a rank directory was refused

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def open_root(path: str) -> int | None:
    """The memory root's descriptor (the configured path itself may be a link: it is the
    operator's), None when there is none."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None


def names(fd: int) -> list[str]:
    """The entries of the directory open as ``fd``, sorted."""
    with os.scandir(fd) as it:
        return sorted(e.name for e in it)


def _is_link(err: OSError) -> bool:
    # O_NOFOLLOW on a link: ELOOP; O_DIRECTORY on a link (some kernels) or a file: ENOTDIR
    return err.errno in (errno.ELOOP, errno.ENOTDIR)


def private_dir(parent_fd: int, name: str, where: str, uid: int | None = None) -> tuple[int, int]:
    """(descriptor, owner) of directory ``name`` under ``parent_fd``: not a link, owned by ``uid``
    (when given), no access for group or others (a job's directories are 0700). Raises
    :class:`SlotError` saying what is wrong; ``FileNotFoundError`` when it went away."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as err:
        if not _is_link(err):
            raise
        raise SlotError(f"{where}: a symbolic link or not a directory: never followed, its slots are not read",
                        hint="remove it; a job creates its region and rank directories itself") from None
    st = os.fstat(fd)
    problem = None
    if st.st_mode & 0o077:
        problem = f"mode {stat.S_IMODE(st.st_mode):04o}, other users may change it (a region's directories are 0700)"
    elif uid is not None and st.st_uid != uid:
        problem = f"owned by uid {st.st_uid}, not by its region's user (uid {uid})"
    if problem:
        os.close(fd)
        raise SlotError(f"{where}: {problem}: its slots are not read", hint="remove it; the job re-creates it 0700")
    return fd, st.st_uid


def open_slot(dir_fd: int, name: str, where: str) -> int:
    """A slot's read-only descriptor under its rank directory's, never through a link (the owner
    and mode checks are :func:`ckptd.storage.memslot.snapshot_at`'s, on this descriptor)."""
    try:
        return os.open(name, SLOT_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise SlotError(f"{where}: a symbolic link: never followed", hint="remove it; the job re-creates its slots") from None


def exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def remove_tree(parent_fd: int, name: str) -> None:
    """Remove directory ``name`` under ``parent_fd`` and everything in it, by name under
    descriptors: a link inside is unlinked, never followed; a link in ``name``'s place is
    unlinked itself. Errors are left to the next release (a job writing there again)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    except OSError as err:
        if _is_link(err):
            _unlink(parent_fd, name)
        return
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                remove_tree(fd, child)
            else:
                _unlink(fd, child)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except OSError:
        pass


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def head_at(root: str, path: str, nbytes: int) -> bytes | None:
    """The first ``nbytes`` of the slot ``path`` (``<root>/<region>/<rank dir>/<slot>``), reached
    as a scan reaches it: each level by descriptor, never through a link, the directories checked
    as :func:`private_dir` does. None when it is not there or is refused."""
    parts = os.path.relpath(path, root).split(os.sep)
    root_fd = open_root(root)
    if len(parts) != 3 or root_fd is None or ".." in parts:
        if root_fd is not None:
            os.close(root_fd)
        return None
    fds = [root_fd]
    try:
        region_fd, uid = private_dir(root_fd, parts[0], os.path.join(root, parts[0]))
        fds.append(region_fd)
        fds.append(private_dir(region_fd, parts[1], os.path.dirname(path), uid)[0])
        fds.append(open_slot(fds[-1], parts[2], path))
        return os.pread(fds[-1], nbytes, 0)
    except (OSError, SlotError):
        return None
    finally:
        for fd in fds:
            os.close(fd)
