"""A directory held by descriptor: the writer's verbs, each relative to that descriptor.

A conversion writes its set into a hidden temp tree inside its output directory and finalizes it
by renaming each rank directory into place (never replacing one) and writing its manifest last.
Every one of those steps goes through a :class:`Dir` — a directory reached without symlinks
(:meth:`ckptd.storage.PosixStorage.open_dir`, or the operator's own ``--out``) and then named only
by its descriptor — so swapping any directory for a symlink meanwhile redirects nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import BinaryIO, Iterator

from ckptd.atomic import atomic_write
from ckptd.storage import beneath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class Dir:
    """The directory ``path`` (what messages call it) open as ``fd``; ``owned``: :meth:`close`
    closes the descriptor (a caller's descriptor is left to the caller)."""

    def __init__(self, fd: int, path: str, *, owned: bool = False) -> None:
        self.fd, self.path, self._owned = fd, path, owned

    @classmethod
    def open_given(cls, path: str) -> Dir:
        """The operator's output directory outside any checkpoint root, created if missing (a
        symlink on the way there is their choice)."""
        os.makedirs(path, exist_ok=True)
        return cls(os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)), path, owned=True)

    def close(self) -> None:
        if self._owned:
            os.close(self.fd)

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def child(self, name: str) -> str:
        return os.path.join(self.path, name)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def exists(self, name: str) -> bool:
        """Something is there under ``name`` (a symlink counts; it is not followed)."""
        return beneath.exists_at(self.fd, name)

    def read(self, name: str, limit: int) -> bytes:
        """A regular one-link file's bytes, at most ``limit`` (anything else is refused)."""
        return beneath.read_fd(beneath.open_at(self.fd, name, self.child(name)), self.child(name), limit)[0]

    def mkdir(self, name: str, mode: int = 0o700) -> Dir:
        """A new directory ``name``, open (the caller closes it)."""
        os.mkdir(name, mode, dir_fd=self.fd)
        return Dir(os.open(name, _DIR_FLAGS, dir_fd=self.fd), self.child(name), owned=True)

    def is_real_dir(self, name: str) -> bool:
        """``name`` is a directory, not a symlink to one (raises ``OSError`` when it is neither)."""
        os.close(beneath.open_dir_at(name, self.fd, self.child(name)))
        return True

    @contextlib.contextmanager
    def create(self, name: str, *, overwrite: bool = False) -> Iterator[BinaryIO]:
        """An atomic write of ``name``: temp, fsync, rename, all relative to the descriptor."""
        with atomic_write(name, overwrite=overwrite, dir_fd=self.fd) as fh:
            yield fh

    def move_into(self, name: str, dest: Dir) -> None:
        """Rename ``name`` into ``dest`` under the same name, never replacing what is there
        (``FileExistsError``)."""
        beneath.rename_noreplace(self.fd, name, dest.fd, name)

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def remove_tree(self, name: str) -> None:
        """``rm -r`` of the real directory ``name`` (descriptor-based: no symlink is followed)."""
        shutil.rmtree(name, dir_fd=self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)
