"""Catalogued shards whose path no longer holds a regular file reached without symlinks.

A verified shard can be swapped afterwards — by a symlink (to a file outside the root), a FIFO,
a device node, or its rank directory by a symlinked directory. Its old verdict is about a file
that is no longer there: the row becomes ``corrupt`` with a reason naming what replaced it (the
new thing is never read), so the step leaves ``verified`` and the resume oracle skips it, saying
why. Ingest calls this where it ignores such a path (file events) and for catalogued paths a
rescan did not list (a symlinked rank directory is never listed). The row's stat becomes all
zeros, which no real file has: a regular file put back at the path is examined and verified anew.

Such a thing where no shard was ever catalogued (a FIFO or symlink named like a shard, a rank
directory that is a symlink) is never read either; the step it would complete then waits for a
rank with a reason saying why (:func:`note_unread`, :func:`note_linked_rank_dir`) instead of none.
The reason goes with the step's next change (a real file registering clears it).
"""

from __future__ import annotations

import os
import stat
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.catalog import repo, scanrows
from ckptd.states import StepState
from ckptd.storage import ConfinementError, PosixStorage, kind_of

ERROR_CODE = "replaced"


def what_replaced(store: PosixStorage, path: str) -> str | None:
    """Why ``path`` is no longer a shard file ckptd may read, or None (regular, or simply gone)."""
    try:
        os.close(store.open_fd(path))
        return None
    except FileNotFoundError:
        return None  # vanished: ingest's deletion handling owns that
    except ConfinementError as err:
        # an lstat follows a symlinked directory on the way: a regular file then is one elsewhere
        st = store.stat(path)
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            return f"replaced: {err.message}"
        if st is None or stat.S_ISREG(st.st_mode):
            return f"replaced: {err.message} (reached through a symlinked directory): not read"
        return f"replaced by a {kind_of(st.st_mode)}: not read"
    except OSError as err:
        return f"cannot be opened any more ({err.strerror}): not read"


def mark_replaced(sessions: sessionmaker[Session], store: PosixStorage, paths: list[str], owner: repo.Owner) -> list[str]:
    """Invalidate the rows of those ``paths`` that are catalogued, owned here and replaced (see
    module docstring). Returns the paths whose rows changed."""
    why = {p: w for p in paths if (w := what_replaced(store, p)) is not None}
    if not why:
        return []
    with sessions() as s:
        rows = scanrows.live_rows_at(s, sorted(why))
    by_step: dict[int, list[tuple[int, str]]] = {}
    for shard_id, path, ckpt_id, node, error in rows:
        if owner.may_take(node) and error != why[path]:  # not another live node's file, not already said
            by_step.setdefault(ckpt_id, []).append((shard_id, path))
    changed = []
    for ckpt_id, shards in sorted(by_step.items()):  # one transaction per step
        with sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)  # lock order: checkpoint, then its shards
            for shard_id, path in shards:
                scanrows.mark_replaced(s, shard_id, ERROR_CODE, why[path])
                repo.add_event(s, ckpt_id, shard_id, "rescan", "corrupt", why[path])
            ckpt.step_checks_ok = None
            repo.recompute_step_state(s, ckpt)
        changed.extend(path for _, path in shards)
    return changed


def _what_it_is(store: PosixStorage, path: str) -> str:
    st = store.stat(path)
    if st is None:
        return "gone"
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:  # another name of a file anywhere (ckptd.storage.beneath)
        return f"a file with {st.st_nlink} hard links"
    if stat.S_ISREG(st.st_mode):  # named inside the root, but reached through a symlinked directory
        return "a file reached through a symlinked directory"
    return f"a {kind_of(st.st_mode)}"


def note_unread(sessions: sessionmaker[Session], store: PosixStorage, ignored: dict[str, runlayout.ShardName]) -> int:
    """Steps still waiting for a rank whose file is there but is no regular file beneath the root:
    their reason says what it is (once; an existing reason is kept). Returns the steps noted."""
    noted = 0
    for path, name in sorted(ignored.items()):
        why = f"rank {name.rank}: {os.path.basename(path)} is {_what_it_is(store, path)}, not a regular file: never read"
        noted += _note(sessions, name.run, why, name=(name.prefix, name.epoch, name.step, name.kind))
    return noted


def note_linked_rank_dir(sessions: sessionmaker[Session], run: str, rank: int, path: str) -> int:
    """A rank directory that is a symlink is never followed (nothing in it is catalogued): the
    run's steps waiting for that rank say so."""
    return _note(sessions, run, f"rank {rank}: its directory {os.path.basename(path)} is a symlink: never followed",
                 missing_rank=rank)


def _note(sessions: sessionmaker[Session], run: str, why: str, **which: Any) -> int:
    """Give ``why`` as the reason of the run's reasonless incomplete steps ``which`` names
    (``scanrows.unexplained_incomplete``)."""
    with sessions() as s:
        ids = scanrows.unexplained_incomplete(s, run, **which)
    for ckpt_id in ids:
        with sessions.begin() as s:
            ckpt = repo.lock_checkpoint(s, ckpt_id)
            if ckpt.state == StepState.INCOMPLETE.value and ckpt.reason is None:
                ckpt.reason = why
    return len(ids)
