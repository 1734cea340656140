"""MindFormers Checkpoint 2.0's commit record, ``latest_checkpointed_iteration.txt``: read it as a
hint, say where it is wrong, and — only when asked — repair it.

MindFormers' resume (``get_checkpoint_path``) trusts the tracker alone: an empty or torn one fails
the launch, one that names a rotated-away or half-rewritten iteration fails or loads a partial
save. The resume oracle answers from the catalog instead and reports the tracker's state next to
the answer. :func:`repair` rewrites the record to the answered iteration for launchers that run
MindFormers unmodified (``load_checkpoint`` = the ``checkpoint`` directory): temp file, fsync,
rename, fsync of the directory — unlike MindFormers' in-place write — all relative to one
descriptor of ``checkpoint/`` opened beneath the root (``ckptd.storage``), never by name.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any

from ckptd import runlayout
from ckptd.errors import CkptdError
from ckptd.format import mf2
from ckptd.atomic import atomic_write
from ckptd.storage import ConfinementError, PosixStorage, beneath, kind_of

TRACKER_MODE = 0o640  # what MindFormers leaves


@dataclass(frozen=True)
class Tracker:
    path: str
    iteration: int | None  # what it names; None when it names nothing
    problem: str | None  # why it is unusable (absent, empty, torn, not a regular file)


def read(store: PosixStorage, run_path: str) -> Tracker:
    path = runlayout.tracker_path(run_path)
    try:
        raw = store.read(path, mf2.MAX_TRACKER_BYTES)
    except FileNotFoundError:
        return Tracker(path, None, "absent (no save finalized yet, or written elsewhere)")
    except (OSError, ConfinementError) as err:
        return Tracker(path, None, f"unreadable: {getattr(err, 'message', None) or err}")
    parsed = mf2.parse_tracker(raw)
    return Tracker(path, parsed, None) if isinstance(parsed, int) else Tracker(path, None, parsed)


def judge(store: PosixStorage, tracker: Tracker, chosen: int, states: dict[int, tuple[str, str | None]],
          run_path: str) -> dict[str, Any]:
    """The answer's ``tracker`` block: what it names and whether MindFormers, trusting it, would
    load the answered iteration. ``states``: catalogued iteration -> (state, reason)."""
    out: dict[str, Any] = {"path": tracker.path, "iteration": tracker.iteration, "agrees": tracker.iteration == chosen}
    it = tracker.iteration
    if it is None:
        note = f"unusable: {tracker.problem}; MindFormers' get_checkpoint_path fails or treats the directory as an iteration"
    elif it == chosen:
        note = "names the answered iteration"
    elif not store.is_dir(runlayout.iteration_dir(run_path, it)):
        note = f"names iteration {it}, which does not exist (rotated away before an async save was finalized?)"
    elif it in states and states[it][0] != "verified":
        state, reason = states[it]
        note = f"names iteration {it}, which is {state}" + (f": {reason}" if reason else "")
    elif it < chosen:
        note = (f"lags: names iteration {it}; {chosen} is whole (every file present and verified) but an async save's "
                "finalize has not advanced the tracker yet, or the job died before it")
    else:
        note = f"names iteration {it}, which the oracle passed over (see skipped)"
    out["note"] = note
    return out


def repair(store: PosixStorage, run_path: str, iteration: int, *, verified: bool, dry_run: bool = False) -> dict[str, Any]:
    """Make the tracker name ``iteration`` (a verified iteration: the caller's evidence). Refuses
    anything unverified or absent; writes nothing when it already agrees or on ``dry_run``."""
    before = read(store, run_path)
    target_dir = runlayout.iteration_dir(run_path, iteration)
    if not verified:
        raise CkptdError(f"refusing to point the tracker at iteration {iteration}: it is not verified",
                         path=before.path, hint="repair only to the oracle's answer (ckptd resume --repair-tracker)")
    result: dict[str, Any] = {"path": before.path, "before": before.iteration, "before_problem": before.problem,
                              "after": iteration, "dry_run": dry_run, "written": False}
    # every check and the write act on one descriptor of checkpoint/, opened from the root without
    # following a symlink: swapping the directory for a link meanwhile redirects nothing
    ckpt_dir = os.path.dirname(before.path)
    try:
        dir_fd = store.open_dir(ckpt_dir)
    except (FileNotFoundError, NotADirectoryError, ConfinementError) as err:
        raise _not_real(iteration, target_dir, err) from None
    try:
        try:
            mode = os.stat(os.path.basename(target_dir), dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError as err:
            raise _not_real(iteration, target_dir, err) from None
        if not stat.S_ISDIR(mode):
            raise _not_real(iteration, target_dir, f"it is a {kind_of(mode)}")
        if before.iteration == iteration or dry_run:
            return result
        name = os.path.basename(before.path)
        if beneath.exists_at(dir_fd, name):
            try:
                os.close(beneath.open_at(dir_fd, name, before.path, hardlinks=store.hardlinks))
            except (OSError, ConfinementError) as err:
                raise CkptdError(f"refusing to replace the tracker: {getattr(err, 'message', None) or err}",
                                 path=before.path, hint="remove it by hand after checking what it is") from None
        with atomic_write(name, overwrite=True, mode=TRACKER_MODE, dir_fd=dir_fd) as fh:
            fh.write(str(iteration).encode())  # MindFormers' own format: the number, no newline
    finally:
        os.close(dir_fd)
    result["written"] = True
    return result


def _not_real(iteration: int, target_dir: str, why: object) -> CkptdError:
    return CkptdError(f"refusing to point the tracker at iteration {iteration}: its directory is not a real "
                      f"directory below the root ({getattr(why, 'message', why)})", path=target_dir,
                      hint="rescan the root (it changed since it was verified)")
