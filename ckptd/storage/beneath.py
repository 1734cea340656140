"""Descriptor-level primitives of the POSIX backend: reach a name below a root without ever
following a symlink, and act on it through directory descriptors.

Any job can write into the checkpoint root, and ckptd often runs as root, so a path from the root
is hostile until proven otherwise. :func:`open_beneath` resolves a path one component at a time
from the root's own directory descriptor with ``O_NOFOLLOW`` (a symlink anywhere is refused, not
followed), checks the final name with ``lstat`` before opening (a device node is never opened:
opening some acts), opens it ``O_NONBLOCK`` (a FIFO planted under a checkpoint name must not
block a thread forever) and ``fstat``s the descriptor it got (the name may have been swapped
meanwhile). Only regular files pass, and only with one link unless the caller allows hard links:
a hard link planted under the root is another name of a file anywhere on that filesystem
(``/etc/shadow`` on a root-owned one). Because every step works on descriptors, nothing can be
swapped between the check and the use.

Writes reach their directory with :func:`open_dir_beneath` (``create=True``: ``mkdirat`` per
missing component) and then create and rename *relative to that descriptor*
(:func:`rename_noreplace`), so swapping a directory for a symlink while it writes redirects
nothing. :class:`ckptd.storage.posix.PosixStorage` is the path-level face of these primitives;
the conversion writer and :mod:`ckptd.atomic` use them directly on the descriptors they hold.
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


class ConfinementError(CkptdError):
    code = "confinement"
    default_hint = ("ckptd only reads and writes regular files and real directories inside its checkpoint root; "
                    "remove the symlink or special file")


def components(root: str, path: str) -> list[str]:
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


def open_dir_at(name: str, dir_fd: int | None, path: str) -> int:
    """A descriptor of the real directory ``name`` in ``dir_fd`` (a symlink in its place is refused)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConfinementError(f"{name!r} is a symlink or not a directory", path=path) from None
        raise


def _open_dir_in(name: str, dir_fd: int, path: str, create: bool) -> int:
    """:func:`open_dir_at`, with ``create`` making it first when missing. A directory that is gone
    again between our ``mkdirat`` and the open was moved or removed by someone else writing in
    the root: a refusal, never a raw ``FileNotFoundError``."""
    try:
        return open_dir_at(name, dir_fd, path)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=dir_fd)
    try:
        return open_dir_at(name, dir_fd, path)
    except FileNotFoundError:
        raise ConfinementError(f"{name!r} was moved or removed while ckptd created it", path=path,
                               hint="something else writes there: find out what before trying again") from None


def open_root(root: str) -> int:
    # the root itself may be a symlink (an operator's mount choice); nothing below it may
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)


@contextlib.contextmanager
def walk(root: str, parts: list[str], path: str, create: bool = False) -> Iterator[int]:
    """A descriptor of the directory holding ``parts[-1]`` (each component a real directory)."""
    fd = open_root(root)
    try:
        for name in parts[:-1]:
            nfd = _open_dir_in(name, fd, path, create)
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def open_beneath(root: str, path: str, *, hardlinks: bool = False) -> int:
    """A read-only descriptor of the regular file ``path`` below ``root`` (see module docstring).
    Raises :class:`ConfinementError` for symlinks, special files, hard links and escapes, and the
    usual ``FileNotFoundError`` when it is not there."""
    parts = components(root, path)
    with walk(root, parts, path) as dir_fd:
        return open_at(dir_fd, parts[-1], path, hardlinks=hardlinks)


def open_at(dir_fd: int, name: str, path: str, *, hardlinks: bool = False) -> int:
    """:func:`open_beneath` of ``name`` in a directory descriptor already reached that way
    (``path``: what errors call it; ``hardlinks``: files with more than one name pass)."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    _check_file(st, path, hardlinks)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfinementError("became a symlink", path=path) from None
        raise
    try:
        _check_file(os.fstat(fd), path, hardlinks)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_file(st: os.stat_result, path: str, hardlinks: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfinementError(f"not a regular file ({kind_of(st.st_mode)})", path=path)
    if st.st_nlink > 1 and not hardlinks:
        raise ConfinementError(f"has {st.st_nlink} hard links: another name of a file that may live anywhere on this "
                               "filesystem; not read", path=path,
                               hint="remove the extra link (ckptd writes and reads files with one name), or set "
                                    "allow_hardlinks = true if your storage links checkpoint files on purpose")


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


def open_dir_beneath(root: str, path: str, *, create: bool = False) -> int:
    """A descriptor of the real directory ``path`` below ``root``, every component reached without
    a symlink (``create``: missing ones made with ``mkdirat``, as ``mkdir -p``). Write below it by
    descriptor (``dir_fd=``), never by name: the name may be swapped, the descriptor not."""
    parts = components(root, path)
    with walk(root, parts, path, create=create) as dir_fd:
        return _open_dir_in(parts[-1], dir_fd, path, create)


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


def kind_of(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words (for reasons and logs)."""
    for test, name in ((stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


def rmtree_at(dir_fd: int, name: str, path: str) -> None:
    """``rm -r`` of the real directory ``name`` in ``dir_fd``. shutil's descriptor-based rmtree
    never follows a symlink inside the tree; a symlink as ``name`` itself is refused."""
    os.close(open_dir_at(name, dir_fd, path))
    if not shutil.rmtree.avoids_symlink_attacks:  # only the fd-based implementation is safe here
        raise ConfinementError("this platform's rmtree may follow symlinks; not deleted", path=path)
    shutil.rmtree(name, dir_fd=dir_fd)
