"""A converted copy's files and rows: where it is written, its strategy file, its catalog rows.

A conversion below the checkpoint root writes through one descriptor of its output directory,
opened from the root without following a symlink (:func:`open_output`, the confined store): the
executor creates, fsyncs and renames everything relative to it -- rank directories, the strategy
file, and last the set's manifest, its commit (:mod:`ckptd.convert.manifest`) -- and before the
copy is catalogued :meth:`ckptd.storage.PosixStorage.same_dir` checks that the output path still names that
directory (one moved away mid-conversion is not catalogued: what it created is removed again,
manifest first, through the descriptor). What the catalog stores is what ckptd wrote -- the
strategy bytes it encoded, each file's digest taken while writing it and its stat -- never what a
name resolves to later, and nothing is read back to learn it.

One copy row exists per (step, target layout) (the unique key of ``checkpoints``). A copy whose
files are lost (the daemon's rescan marked it ``deleted``/``incomplete``/``corrupt``, or this
node's files are not the ones catalogued) is replaced by converting again: :func:`register`
re-uses its row. A copy that is whole elsewhere, another node's, or being deleted by retention
blocks the conversion with a reason (:func:`blocking_copy`) before anything is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.catalog import jobrows, reads, repo
from ckptd.catalog.models import Checkpoint, Shard
from ckptd.service.catalog import InvalidRequestError
from ckptd.service.verifier import stat_of
from ckptd.storage import PosixStorage
from ckptd.storage.dirs import Dir
from ckptd.states import ShardState, StepState

LOST_STATES = (StepState.DELETED.value, StepState.INCOMPLETE.value, StepState.CORRUPT.value)


@dataclass(frozen=True)
class WrittenFile:
    rank: int
    path: str
    stat: repo.FileStat
    digest: str


def open_output(store: PosixStorage, out: str) -> Dir:
    """The output directory, open and created if missing: below the root every component a real
    directory reached from the root's descriptor; elsewhere (the operator's ``--out``) as given."""
    if runlayout.relative_parts(store.root, out) is not None:
        return Dir(store.open_dir(out, create=True), out, owned=True)
    return Dir.open_given(out)


def written_files(report: Any) -> list[WrittenFile]:
    """Each rank's file as the conversion wrote it: its stat and the digest taken while writing
    (:class:`ckptd.convert.execute.RankReport`; the set's manifest holds the same). Nothing is
    read again."""
    return [WrittenFile(r.rank, r.path, repo.FileStat(r.bytes, r.mtime_ns, r.inode), r.digest) for r in report.ranks]


def discard(out: Dir, report: Any) -> None:
    """Take back a written set that failed to be catalogued (:func:`ckptd.convert.execute.undo_commit`:
    its manifest first -- an earlier set's put back -- then what it created)."""
    from ckptd.convert.execute import undo_commit

    undo_commit(out, report.created, report.earlier_manifest)


def _copy_of(s: Session, meta: tuple, target_hash: str, lock: bool = False) -> Checkpoint | None:
    run_id, prefix, epoch, step, _ = meta
    return jobrows.copy_row(s, run_id, prefix, epoch, step, target_hash, lock)


def blocking_copy(s: Session, store: PosixStorage, meta: tuple, target_hash: str, node: str) -> str | None:
    """Why the existing copy of this step in this layout may not be replaced, or None (there is
    none, or it is lost)."""
    copy = _copy_of(s, meta, target_hash)
    return None if copy is None else _why_kept(s, store, copy, node)


def _why_kept(s: Session, store: PosixStorage, copy: Checkpoint, node: str) -> str | None:
    if copy.state in LOST_STATES:
        return None  # the daemon judged its files: gone or broken
    rows = jobrows.shard_stats_and_nodes(s, copy.id)
    where = os.path.dirname(os.path.dirname(rows[0][0])) if rows else "?"
    if copy.state != StepState.VERIFIED.value:
        return f"the converted copy of this step in this layout ({where}) is {copy.state}; try again once it is not"
    others = sorted({n for *_, n in rows if n not in (None, node)})
    if others:
        return f"this step is converted to this layout already, on node {others[0]} ({where}): not this node's to replace"
    if rows and all(stat_of(store, p) == repo.FileStat(size, mtime, inode) for p, size, mtime, inode, _ in rows):
        return f"this step is converted to this layout already, at {where}: use that copy, or delete it to convert again"
    return None  # this node's files changed or gone: lost


def register(sessions: sessionmaker[Session], store: PosixStorage, meta: tuple, src_id: int, target: Any, target_hash: str,
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
            why = _why_kept(s, store, ckpt, node)
            if why is not None:  # registered meanwhile by another conversion
                raise InvalidRequestError(why)
            replaced = ckpt.state
        else:
            ckpt = Checkpoint(run_id=run_id, prefix=prefix, epoch=epoch, step=step, kind="converted", strategy_hash=target_hash,
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
