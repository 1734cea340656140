"""Confinement: every file ckptd opens under the checkpoint root is opened through here.

Any job can write into the root, and ckptd often runs as root, so a path from the root is hostile
until proven otherwise. :func:`open_beneath` resolves a path one component at a time from the
root's own directory descriptor with ``O_NOFOLLOW`` — a symlink anywhere (a file, a ``strategy/``
or ``converted/`` directory pointing elsewhere) is refused, not followed — checks the final name
with ``lstat`` before opening (a device node is never opened: opening some acts), opens it
``O_NONBLOCK`` (a FIFO planted under a checkpoint name must not block a thread forever) and
``fstat``s the descriptor it got (the name may have been swapped meanwhile). Only regular files
pass, and only with one link: a hard link planted under the root is another name of a file
anywhere on that filesystem (``/etc/shadow`` on a root-owned one), so a file with more than one
name is refused unless :func:`allow_hardlinks` (the ``allow_hardlinks`` setting) says the storage
links files on purpose. Because every step works on descriptors, nothing can be swapped between
the check and the use.

Writes go through :func:`open_dir_beneath` (``create=True``), which opens — and creates, with
``mkdirat`` — every component from the root's descriptor in the same way; the writer then creates
files and directories *relative to that descriptor* and renames them into place relative to it
(:func:`rename_noreplace`), so swapping a directory for a symlink while it writes redirects
nothing: the descriptor keeps naming the directory that was checked. :func:`same_dir` tells
whether that directory is still the one a path names (a moved-away output is not catalogued).
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
_RENAME_NOREPLACE = 1  # linux/fs.h
_hardlinks_allowed = False  # process-wide: one checkpoint root, one storage (see allow_hardlinks)


class ConfinementError(CkptdError):
    code = "confinement"
    default_hint = ("ckptd only reads and writes regular files and real directories inside its checkpoint root; "
                    "remove the symlink or special file")


def allow_hardlinks(allowed: bool) -> None:
    """Whether files with more than one hard link pass :func:`open_beneath` (the
    ``allow_hardlinks`` setting; the daemon and the catalog commands apply it at start)."""
    global _hardlinks_allowed
    _hardlinks_allowed = bool(allowed)


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


def _open_dir_in(name: str, dir_fd: int, path: str, create: bool) -> int:
    """:func:`_open_dir`, with ``create`` making it first when missing. A directory that is gone
    again between our ``mkdirat`` and the open was moved or removed by someone else writing in
    the root: a refusal, never a raw ``FileNotFoundError``."""
    try:
        return _open_dir(name, dir_fd, path)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=dir_fd)
    try:
        return _open_dir(name, dir_fd, path)
    except FileNotFoundError:
        raise ConfinementError(f"{name!r} was moved or removed while ckptd created it", path=path,
                               hint="something else writes there: find out what before trying again") from None


def _open_root(root: str) -> int:
    # the root itself may be a symlink (an operator's mount choice); nothing below it may
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)


@contextlib.contextmanager
def _walk(root: str, parts: list[str], path: str, create: bool = False) -> Iterator[int]:
    """A descriptor of the directory holding ``parts[-1]`` (each component a real directory)."""
    fd = _open_root(root)
    try:
        for name in parts[:-1]:
            nfd = _open_dir_in(name, fd, path, create)
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def open_beneath(root: str, path: str) -> int:
    """A read-only descriptor of the regular file ``path`` below ``root`` (see module docstring).
    Raises :class:`ConfinementError` for symlinks, special files, hard links and escapes, and the
    usual ``FileNotFoundError`` when it is not there."""
    parts = _components(root, path)
    with _walk(root, parts, path) as dir_fd:
        return open_at(dir_fd, parts[-1], path)


def open_at(dir_fd: int, name: str, path: str) -> int:
    """:func:`open_beneath` of ``name`` in a directory descriptor already reached that way
    (``path``: what errors call it)."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    _check_file(st, path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfinementError("became a symlink", path=path) from None
        raise
    try:
        _check_file(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_file(st: os.stat_result, path: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfinementError(f"not a regular file ({kind_of(st.st_mode)})", path=path)
    if st.st_nlink > 1 and not _hardlinks_allowed:
        raise ConfinementError(f"has {st.st_nlink} hard links: another name of a file that may live anywhere on this "
                               "filesystem; not read", path=path,
                               hint="remove the extra link (ckptd writes and reads files with one name), or set "
                                    "allow_hardlinks = true if your storage links checkpoint files on purpose")


def read_beneath(root: str, path: str, limit: int) -> bytes:
    """The bytes of a regular file below ``root``, at most ``limit`` (more is an error)."""
    return read_with_stat(root, path, limit)[0]


def read_with_stat(root: str, path: str, limit: int) -> tuple[bytes, os.stat_result]:
    """:func:`read_beneath` and the ``fstat`` of the very file read."""
    return read_fd(open_beneath(root, path), path, limit)


def read_fd(fd: int, path: str, limit: int) -> tuple[bytes, os.stat_result]:
    """The bytes (at most ``limit``) and ``fstat`` of a descriptor from :func:`open_beneath` /
    :func:`open_at`, which this closes."""
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
    os.close(open_dir_beneath(root, path, create=True))


def open_dir_beneath(root: str, path: str, *, create: bool = False) -> int:
    """A descriptor of the real directory ``path`` below ``root``, every component reached without
    a symlink (``create``: missing ones made with ``mkdirat``, as ``mkdir -p``). Write below it by
    descriptor (``dir_fd=``), never by name: the name may be swapped, the descriptor not."""
    parts = _components(root, path)
    with _walk(root, parts, path, create=create) as dir_fd:
        return _open_dir_in(parts[-1], dir_fd, path, create)


def same_dir(root: str, path: str, fd: int) -> bool:
    """True if ``path`` below ``root`` (reached without symlinks) is the directory ``fd`` holds."""
    try:
        other = open_dir_beneath(root, path)
    except (ConfinementError, OSError):
        return False
    try:
        a, b = os.fstat(other), os.fstat(fd)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    finally:
        os.close(other)


def exists_at(dir_fd: int, name: str) -> bool:
    """``os.path.lexists`` of a name in a directory descriptor (a symlink exists; it is not followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _load_renameat2():  # noqa: ANN202 - a ctypes function or None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def rename_noreplace(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> None:
    """Rename ``src`` (in ``src_dir_fd``) to ``dst`` (in ``dst_dir_fd``), never replacing whatever
    ``dst`` is (``FileExistsError``): ``renameat2(RENAME_NOREPLACE)``, or an ``lstat`` and
    ``renameat`` where the kernel or filesystem lacks it (rename replaces an empty directory)."""
    if _renameat2 is not None:
        import ctypes

        if _renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), dst)
    if exists_at(dst_dir_fd, dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)


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


def unlink_if_older_beneath(root: str, path: str, before: float, *, dry_run: bool = False) -> bool:
    """Remove the regular file ``path`` below ``root`` if it was last modified before ``before`` (a
    POSIX time), judged on the name in a directory reached without symlinks; False: newer, kept.
    ``dry_run``: judge only. (Torn temp files: a writer still at work keeps touching its file.)"""
    parts = _components(root, path)
    with _walk(root, parts, path) as dir_fd:
        st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise ConfinementError(f"is a {kind_of(st.st_mode)}, not a file ckptd may remove", path=path)
        if st.st_mtime >= before:
            return False
        if not dry_run:
            os.unlink(parts[-1], dir_fd=dir_fd)
        return True


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
