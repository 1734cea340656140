"""Opening a catalogued shard below the root for parsing, through the confined store (:class:`ckptd.storage.PosixStorage`).

Ingest's parse check and the step checks' facts used to open shards by name after an ``lstat``:
a FIFO swapped in between blocked the thread in ``open()`` forever, a symlink was followed out of
the root. Here the file is opened non-blocking, regular files only, with no symlinked component,
and the readers get the descriptor's ``/proc/self/fd`` name; errors name the shard's real path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ckptd.errors import CkptdError
from ckptd.format.checkpoint import CheckpointFile, open_checkpoint
from ckptd.format.index_cache import IndexCache
from ckptd.storage import PosixStorage


def _named(err: CkptdError, path: str) -> CkptdError:
    err.path = path  # the reader saw the /proc/self/fd name; the operator needs the shard's
    err.args = (str(err),)
    return err


@contextlib.contextmanager
def open_shard(store: PosixStorage, path: str, key: bytes | None, index_cache: IndexCache | None = None,
               ) -> Iterator[CheckpointFile]:
    """``open_checkpoint`` of the confined file ``path``; raises :class:`CkptdError` (a
    ``ConfinementError`` for a symlink, FIFO or device) or ``OSError``."""
    with store.opened(path) as name:
        try:
            ck = open_checkpoint(name, key, index_cache=index_cache)
        except CkptdError as err:
            raise _named(err, path) from None
        with ck:
            yield ck


def parse_error(store: PosixStorage, path: str, key: bytes | None, index_cache: IndexCache | None = None) -> CkptdError | None:
    """Why ``path`` does not parse (record headers only), or None: a shard is 'complete' only
    once it does. A ``ConfinementError``: it is no regular file reached
    without symlinks (never read)."""
    try:
        if path.endswith(".json"):  # a Checkpoint 2.0 record: parsed whole by the verifier; confined here too
            os.close(store.open_fd(path))
            return None
        with open_shard(store, path, key, index_cache):
            return None
    except CkptdError as err:
        return err
    except OSError as err:
        return CkptdError(f"cannot read: {err.strerror}", path=path)
