"""Storage tiers: the verbs ckptd needs (:mod:`ckptd.storage.base`) and their backends.

``PosixStorage`` (:mod:`ckptd.storage.posix`) is a checkpoint root, confined: nothing below the
root is followed through a symlink, opened as a special file or deleted through a link
(:mod:`ckptd.storage.beneath` holds the descriptor-level primitives).
"""

from ckptd.storage import beneath
from ckptd.storage.base import Entry, Storage, file_uri
from ckptd.storage.beneath import ConfinementError, kind_of
from ckptd.storage.posix import PosixStorage

__all__ = ["ConfinementError", "Entry", "PosixStorage", "Storage", "beneath", "file_uri", "kind_of"]
