"""The POSIX backend: a checkpoint root on a local or shared file system, confined.

Every read, listing, write and deletion of ckptd's service, converter and daemon below a
checkpoint root goes through one :class:`PosixStorage` of that root. Each verb resolves its path
one component at a time from the root's own descriptor (:mod:`ckptd.storage.beneath`): a symlink,
FIFO, device or planted hard link anywhere below the root is refused with a
:class:`~ckptd.storage.beneath.ConfinementError`, never followed, opened or deleted through.

Paths are the absolute paths the catalog stores (a shard row's ``path``); :meth:`PosixStorage.uri`
names the same file as a location another tier can be compared with (``file://``).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO
from dataclasses import dataclass

from ckptd.atomic import atomic_write
from ckptd.storage import beneath
from ckptd.storage.base import Entry, file_uri
from ckptd.storage.beneath import ConfinementError


@dataclass(frozen=True)
class PosixStorage:
    """The checkpoint root ``root``; ``hardlinks``: files with more than one name pass (the
    ``allow_hardlinks`` setting, for storage that links checkpoint files on purpose)."""

    root: str
    hardlinks: bool = False

    scheme = "file"

    def uri(self, path: str) -> str:
        return file_uri(path)

    # --- reading -----------------------------------------------------------------------------

    def open_fd(self, path: str) -> int:
        """A read-only descriptor of the regular file ``path`` (the caller closes it).
        ``FileNotFoundError`` when it is not there."""
        return beneath.open_beneath(self.root, path, hardlinks=self.hardlinks)

    @contextlib.contextmanager
    def opened(self, path: str) -> Iterator[str]:
        """The file as a byte source for the format readers: ``with store.opened(p) as name:``,
        ``name`` reopens exactly the confined inode (``/proc/self/fd/<n>``), never the path."""
        fd = self.open_fd(path)
        try:
            yield beneath.proc_path(fd)
        finally:
            os.close(fd)

    def read(self, path: str, limit: int) -> bytes:
        """The bytes of the file, at most ``limit`` (more is a :class:`ConfinementError`)."""
        return self.read_with_stat(path, limit)[0]

    def read_with_stat(self, path: str, limit: int) -> tuple[bytes, os.stat_result]:
        """:meth:`read` and the ``fstat`` of the very file read."""
        return beneath.read_fd(self.open_fd(path), path, limit)

    def is_file(self, path: str) -> bool:
        """A regular file reached without symlinks (never raises)."""
        try:
            os.close(self.open_fd(path))
            return True
        except (ConfinementError, OSError):
            return False

    def stat(self, path: str) -> os.stat_result | None:
        """``lstat`` of the name (a symlink is itself, not followed); None when nothing is there.
        For deciding what a name now holds; reading it goes through :meth:`opened`."""
        try:
            return os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def exists(self, path: str) -> bool:
        """Something is at ``path`` (a symlink counts: it is there, and refused when read)."""
        return os.path.lexists(path)

    def is_dir(self, path: str) -> bool:
        st = self.stat(path)
        return st is not None and stat.S_ISDIR(st.st_mode)

    # --- listing -----------------------------------------------------------------------------

    def list(self, path: str) -> list[str]:
        """The names in the real directory ``path``, every component reached without a symlink."""
        with self.dir(path) as fd:
            return os.listdir(fd)

    def entries(self, path: str) -> list[Entry]:
        """Names and kinds (from the directory entry, no symlink followed) in ``path``, for the
        rescans' walks: one ``getdents`` per directory. The names are only names: each file is
        then opened, and each directory listed, through the confined verbs."""
        with os.scandir(path) as it:
            return [Entry(e.name, _kind(e)) for e in it]

    def check_dir(self, path: str) -> None:
        """Raise :class:`ConfinementError` unless every existing component of ``path`` is a real
        directory (a missing tail is fine: nothing there to follow)."""
        parts = beneath.components(self.root, path)
        fd = beneath.open_root(self.root)
        try:
            for name in parts:
                try:
                    nfd = beneath.open_dir_at(name, fd, path)
                except FileNotFoundError:
                    return
                os.close(fd)
                fd = nfd
        finally:
            os.close(fd)

    # --- writing -----------------------------------------------------------------------------

    def open_dir(self, path: str, *, create: bool = False) -> int:
        """A descriptor of the real directory ``path`` (``create``: ``mkdir -p`` with ``mkdirat``).
        Writers create, rename and fsync relative to it (``dir_fd=``), never by name."""
        return beneath.open_dir_beneath(self.root, path, create=create)

    @contextlib.contextmanager
    def dir(self, path: str, *, create: bool = False) -> Iterator[int]:
        fd = self.open_dir(path, create=create)
        try:
            yield fd
        finally:
            os.close(fd)

    def same_dir(self, path: str, fd: int) -> bool:
        """``path`` still names the directory ``fd`` holds (a moved-away output is not catalogued)."""
        try:
            other = self.open_dir(path)
        except (ConfinementError, OSError):
            return False
        try:
            a, b = os.fstat(other), os.fstat(fd)
            return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
        finally:
            os.close(other)

    @contextlib.contextmanager
    def create(self, path: str, *, overwrite: bool = False, mode: int = 0o644) -> Iterator[BinaryIO]:
        """Create (``overwrite``: or replace) the file atomically: temp, fsync, rename, fsync the
        directory, all relative to its directory's confined descriptor. An exception inside the
        block leaves nothing behind."""
        with self.dir(os.path.dirname(path), create=True) as fd, \
                atomic_write(os.path.basename(path), overwrite=overwrite, mode=mode, dir_fd=fd) as fh:
            yield fh

    def write(self, path: str, data: bytes, *, overwrite: bool = False, mode: int = 0o644) -> None:
        with self.create(path, overwrite=overwrite, mode=mode) as fh:
            fh.write(data)

    # --- deleting ----------------------------------------------------------------------------

    def delete(self, path: str) -> None:
        """Remove the file: never a symlink or directory in its place (retention deletes what the
        catalog recorded, never what a link points at, nor the link: that is for an operator)."""
        parts = beneath.components(self.root, path)
        with beneath.walk(self.root, parts, path) as dir_fd:
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):
                raise ConfinementError(f"is a {beneath.kind_of(st.st_mode)}, not a file ckptd wrote", path=path)
            os.unlink(parts[-1], dir_fd=dir_fd)

    def delete_if_older(self, path: str, before: float, *, dry_run: bool = False) -> bool:
        """Remove the regular file if last modified before ``before`` (POSIX time); False: newer,
        kept. ``dry_run``: judge only. (Torn temp files: a writer still at work keeps touching its file.)"""
        parts = beneath.components(self.root, path)
        with beneath.walk(self.root, parts, path) as dir_fd:
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise ConfinementError(f"is a {beneath.kind_of(st.st_mode)}, not a file ckptd may remove", path=path)
            if st.st_mtime >= before:
                return False
            if not dry_run:
                os.unlink(parts[-1], dir_fd=dir_fd)
            return True

    def remove_dir(self, path: str) -> None:
        """``rmdir`` of an empty real directory (``OSError`` if not empty)."""
        parts = beneath.components(self.root, path)
        with beneath.walk(self.root, parts, path) as dir_fd:
            os.close(beneath.open_dir_at(parts[-1], dir_fd, path))  # refuses a symlink in its place
            os.rmdir(parts[-1], dir_fd=dir_fd)

    def remove_tree(self, path: str) -> None:
        """``rm -r`` of the real directory (descriptor-based: no symlink inside is followed)."""
        parts = beneath.components(self.root, path)
        with beneath.walk(self.root, parts, path) as dir_fd:
            beneath.rmtree_at(dir_fd, parts[-1], path)


def _kind(entry: os.DirEntry[str]) -> str:
    try:
        if entry.is_symlink():
            return "symlink"
        if entry.is_dir(follow_symlinks=False):
            return "dir"
        if entry.is_file(follow_symlinks=False):
            return "file"
    except OSError:  # gone meanwhile
        return "gone"
    return "special"
