"""What ckptd asks of a storage tier: the verbs every backend implements.

A tier (the POSIX root today; host memory and object storage next) is a backend of this protocol
plus rows in the catalog's table of copies (``shard_copies``: one row per copy of a shard on a
tier, its location a URI). The verbs are the few ckptd uses (after PyTorch DCP's
StorageReader/StorageWriter and Orbax's storage backends): list a directory, stat a name, open a
file as a byte source for the format readers, read a small file whole, write through a temp name
then finalize, delete. Paths are the absolute paths the catalog stores; :meth:`Storage.uri` is a
path's location as a copy row records it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Literal, Protocol
from urllib.parse import quote

EntryKind = Literal["file", "dir", "symlink", "special", "gone"]


@dataclass(frozen=True)
class Entry:
    """One name in a directory listing and what its directory entry says it is (never followed)."""

    name: str
    kind: EntryKind


class Storage(Protocol):
    scheme: str

    def uri(self, path: str) -> str: ...

    def list(self, path: str) -> list[str]: ...

    def entries(self, path: str) -> list[Entry]: ...

    def stat(self, path: str) -> os.stat_result | None: ...

    def opened(self, path: str) -> contextlib.AbstractContextManager[str]: ...

    def read(self, path: str, limit: int) -> bytes: ...

    def write(self, path: str, data: bytes, *, overwrite: bool = False, mode: int = 0o644) -> None: ...

    def delete(self, path: str) -> None: ...

    def remove_tree(self, path: str) -> None: ...


def file_uri(path: str) -> str:
    """The location of a file-tier copy: ``file://`` and the absolute path, percent-encoded."""
    return "file://" + quote(path)
