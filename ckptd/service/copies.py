"""A converted copy's files and rows: where it is written, its strategy file, its catalog rows.

A conversion below the checkpoint root writes through one descriptor of its output directory,
opened from the root without following a symlink (:func:`open_output`, ``ckptd.confine``): the
executor creates, fsyncs and renames everything relative to it, the strategy file is written the
same way, and before the copy is catalogued :func:`ckptd.confine.same_dir` checks that the output
path still names that directory (one moved away mid-conversion is not catalogued: its rank
directories are removed again, through the descriptor). What the catalog stores is what ckptd
wrote — the strategy bytes it encoded, each file's digest and stat read through a confined
descriptor — never what a name resolves to later.

One copy row exists per (step, target layout) (the unique key of ``checkpoints``). A copy whose
files are lost (the daemon's rescan marked it ``deleted``/``incomplete``/``corrupt``, or this
node's files are not the ones catalogued) is replaced by converting again: :func:`register`
re-uses its row. A copy that is whole elsewhere, another node's, or being deleted by retention
blocks the conversion with a reason (:func:`blocking_copy`) before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ckptd import confine, runlayout
from ckptd.catalog import jobrows, reads, repo
from ckptd.catalog.models import Checkpoint, Shard
from ckptd.errors import CkptdError
from ckptd.format.strategy import MAX_STRATEGY_BYTES
from ckptd.service.catalog import InvalidRequestError
from ckptd.service.verifier import file_digest, stat_of
from ckptd.states import ShardState, StepState

LOST_STATES = (StepState.DELETED.value, StepState.INCOMPLETE.value, StepState.CORRUPT.value)


@dataclass(frozen=True)
class WrittenFile:
    rank: int
    path: str
    stat: repo.FileStat
    digest: str


def open_output(root: str, out: str) -> int:
    """A descriptor of the output directory, created if missing: below the root every component
    a real directory reached from the root's descriptor; elsewhere (the operator's ``--out``) as given."""
    if runlayout.relative_parts(root, out) is not None:
        return confine.open_dir_beneath(root, out, create=True)
    from ckptd.convert.execute import open_out_dir

    return open_out_dir(out)


def check_strategy_slot(out_fd: int, path: str, content: bytes) -> None:
    """Refuse a ``strategy.ckpt`` already in the output directory unless it is a regular file
    with exactly ``content`` (a copy converted before): a planted symlink, FIFO, hard link or
    another layout's file is never read into the catalog, followed, or replaced."""
    name = os.path.basename(path)
    if not confine.exists_at(out_fd, name):
        return
    data, _ = confine.read_fd(confine.open_at(out_fd, name, path), path, MAX_STRATEGY_BYTES)
    if data != content:
        raise CkptdError("holds another strategy than this conversion's target; not replaced", path=path,
                         hint="remove it (after checking where it came from) and convert again")


def write_strategy(out_fd: int, path: str, content: bytes) -> bool:
    """Write the copy's strategy file by descriptor (atomically) unless it is already there with
    ``content``; True if written."""
    from ckptd.format.atomic import atomic_write

    check_strategy_slot(out_fd, path, content)  # again: the name may have been swapped since
    if confine.exists_at(out_fd, os.path.basename(path)):
        return False
    with atomic_write(os.path.basename(path), dir_fd=out_fd) as fh:
        fh.write(content)
    return True


def written_files(root: str, out: str, report: Any) -> list[WrittenFile]:
    """Stat and digest of each rank's file as written, read through a confined descriptor below
    the root (by name only for an output outside it: the operator's)."""
    below = runlayout.relative_parts(root, out) is not None
    files = []
    for rank in report.ranks:
        with confine.opened(root, rank.path) if below else contextlib.nullcontext(rank.path) as name:
            st = os.stat(name)
            digest = file_digest(name)
        files.append(WrittenFile(rank.rank, rank.path, repo.FileStat(st.st_size, st.st_mtime_ns, st.st_ino), digest))
    return files


def discard(out_fd: int, report: Any, strategy_name: str | None) -> None:
    """Remove what this conversion renamed into its output directory (through the descriptor:
    a symlink planted in its place is never followed), after it failed to be catalogued."""
    for rank in report.ranks:
        with contextlib.suppress(OSError):
            shutil.rmtree(f"rank_{rank.rank}", dir_fd=out_fd)
    if strategy_name is not None:
        with contextlib.suppress(OSError):
            os.unlink(strategy_name, dir_fd=out_fd)


def _copy_of(s: Session, meta: tuple, target_hash: str, lock: bool = False) -> Checkpoint | None:
    run_id, prefix, epoch, step, _ = meta
    return jobrows.copy_row(s, run_id, prefix, epoch, step, target_hash, lock)


def blocking_copy(s: Session, meta: tuple, target_hash: str, node: str) -> str | None:
    """Why the existing copy of this step in this layout may not be replaced, or None (there is
    none, or it is lost)."""
    copy = _copy_of(s, meta, target_hash)
    return None if copy is None else _why_kept(s, copy, node)


def _why_kept(s: Session, copy: Checkpoint, node: str) -> str | None:
    if copy.state in LOST_STATES:
        return None  # the daemon judged its files: gone or broken
    rows = jobrows.shard_stats_and_nodes(s, copy.id)
    where = os.path.dirname(os.path.dirname(rows[0][0])) if rows else "?"
    if copy.state != StepState.VERIFIED.value:
        return f"the converted copy of this step in this layout ({where}) is {copy.state}; try again once it is not"
    others = sorted({n for *_, n in rows if n not in (None, node)})
    if others:
        return f"this step is converted to this layout already, on node {others[0]} ({where}): not this node's to replace"
    if rows and all(stat_of(p) == repo.FileStat(size, mtime, inode) for p, size, mtime, inode, _ in rows):
        return f"this step is converted to this layout already, at {where}: use that copy, or delete it to convert again"
    return None  # this node's files changed or gone: lost


def register(sessions: sessionmaker[Session], meta: tuple, src_id: int, target: Any, target_hash: str,
             strategy: tuple[str, bytes] | None, files: list[WrittenFile], out_format: str, encrypted: bool,
             node: str) -> int:
    """Catalogue the copy (its files are on the disk of ``node``, the node that wrote them),
    re-using the row of a lost copy of the same step and layout."""
    run_id, prefix, epoch, step, global_step = meta
    now = datetime.now(timezone.utc)
    with sessions.begin() as s:
        strat_id = None
        if strategy is not None:
            run = s.get(repo.Run, run_id)
            strat_id = repo.upsert_strategy(s, run, strategy[0], target_hash, target.format, target.world_size,
                                            target.stages, None, strategy[1]).id
        ckpt = _copy_of(s, meta, target_hash, lock=True)
        replaced = None
        if ckpt is not None:
            why = _why_kept(s, ckpt, node)
            if why is not None:  # registered meanwhile by another conversion
                raise InvalidRequestError(why)
            replaced = ckpt.state
        else:
            ckpt = Checkpoint(run_id=run_id, prefix=prefix, epoch=epoch, step=step, kind="converted", layout=target_hash,
                              pinned=False, marked_bad=False, created_at=now)
            s.add(ckpt)
        ckpt.global_step, ckpt.state, ckpt.reason = global_step, StepState.VERIFIED.value, None
        ckpt.expected_ranks = target.world_size if target is not None else 1
        ckpt.strategy_id, ckpt.step_checks_ok, ckpt.derived_from_id, ckpt.updated_at = strat_id, True, src_id, now
        s.flush()
        old = {sh.rank: sh for sh in reads.shards_of(s, ckpt.id)}
        for f in files:
            sh = old.get(f.rank) or Shard(checkpoint_id=ckpt.id, rank=f.rank, quarantined=False)
            sh.path, sh.size, sh.mtime_ns, sh.inode, sh.digest = f.path, f.stat.size, f.stat.mtime_ns, f.stat.inode, f.digest
            sh.state, sh.format, sh.encryption = ShardState.VERIFIED.value, out_format, "AES-GCM" if encrypted else None
            sh.crc, sh.global_step = "valid" if not encrypted else "absent", global_step
            sh.verified_at, sh.seen_at, sh.node, sh.error, sh.error_code = now, now, node, None, None
            if f.rank in old:  # the lost file's row: its old verdict, facts and claims are of another file
                sh.facts = sh.verified_config = sh.claimed_by = None
                sh.verify_seq = (sh.verify_seq or 0) + 1
            else:
                s.add(sh)
        detail = f"converted from checkpoint {src_id}; every slice re-read and verified"
        repo.add_event(s, ckpt.id, None, "step", "ok", detail + (f"; replaces a lost copy (was {replaced})" if replaced else ""))
        return ckpt.id
