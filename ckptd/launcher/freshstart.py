"""Never a silent fresh start: when the launcher may train a run from step 0.

A fault-tolerance launcher that restarts from zero while the run directory holds saves it could
resume from throws hours of work away without a word -- which is what happened when ``ckptd serve
--root`` did not contain the job's ``--run-dir`` (ckptd answered "run not in the catalog", honestly),
when the run was renamed, or when no oracle was configured at all. So a fresh start over committed
saves needs ``--allow-fresh-start``; without it the launcher stops (exit 2) with one line saying
what to fix. Three checks, each as early as it can be made:

* **at start, ckptd must see the run directory** (:func:`check_watched`): the directory the run
  lives in holds the sharing marker (:func:`ckptd.runlayout.node_marker_path`) of a node the
  answering ckptd knows, and the run name is the directory's own name (ckptd names runs by their
  directory). A filesystem fact, not a comparison of paths: ckptd's root may be mounted at another
  path in its container, or on every node. A symlinked run directory is refused too: ckptd never
  follows links below its root, so it would never see the saves.
* **at start, an oracle must exist** when there will be restarts (:func:`check_oracle`).
* **before any fresh start** (:class:`FreshStart`): if the run directory holds committed saves and
  the oracle does not know the run -- or ``--fresh`` skipped asking -- the start is refused; so is
  one while ckptd has not finished verifying a save (``unjudged`` in its answer: the settle wait
  ran out before ckptd caught up, and that save may still be the resume point).
  "Nothing restorable" from an oracle that knows the run is its verdict (the saves are corrupt,
  say) and is acted on, with its reasons in the log.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ckptd import runlayout
from ckptd.launcher.oracle import OracleError, ResumeAnswer, committed_save_files, get_json

#: what every refusal ends with: the one way to train from zero anyway
OVERRIDE = "--allow-fresh-start trains from step 0 anyway"


class FreshStartRefused(OracleError):
    """The launcher would throw saved work away: stop and say what to fix (exit 2)."""


@dataclass(frozen=True)
class FreshStart:
    """The rule for a start from step 0 (``allowed``: ``--allow-fresh-start``)."""
    allowed: bool = False

    def refusal(self, run_dir: str, world: int, answer: ResumeAnswer | None) -> str | None:
        """Why starting ``run_dir`` from step 0 now would lose saved work (None: it would not, or
        the operator allowed it). ``answer`` None: the oracle was not asked (``--fresh``)."""
        if self.allowed or (answer is not None and answer.step is not None):
            return None
        if answer is not None and answer.unjudged:
            steps = ", ".join(map(str, answer.unjudged[:5])) + (" ..." if len(answer.unjudged) > 5 else "")
            return (f"{answer.why}, but ckptd has not finished verifying step(s) {steps}: they may still be "
                    f"restorable -- give ckptd longer to catch up (--settle-timeout) and launch again; {OVERRIDE}")
        if answer is not None and answer.unjudged_unreachable:
            steps = ", ".join(f"{step} (node {', '.join(nodes)})" for step, nodes in
                              list(answer.unjudged_unreachable.items())[:5])
            return (f"{answer.why}, but step(s) {steps} await a verdict only a silent node's daemon can give: they "
                    f"may be restorable -- bring that node's ckptd serve back (or its disk under another node's "
                    f"root); {OVERRIDE}")
        if answer is not None and answer.catalogued:
            return None  # the oracle knows the run and found nothing restorable: its verdict
        saves = committed_save_files(run_dir, world)
        if not saves:
            return None
        shown = ", ".join(saves[:3]) + (f" and {len(saves) - 3} more" if len(saves) > 3 else "")
        if answer is None:
            return (f"--fresh, but {run_dir} holds committed saves ({shown}): drop --fresh to resume from "
                    f"them; {OVERRIDE}")
        return (f"{answer.why}, but {run_dir} holds committed saves ({shown}): the oracle does not see them -- "
                f"check that ckptd serve --root is the directory holding the run dir, that --run-name is the "
                f"run dir's name, and --ckptd-url (or give ckptd longer to catch up: --settle-timeout); {OVERRIDE}")


def check_oracle(has_oracle: bool, max_restarts: int, allowed: bool) -> str | None:
    """Without an oracle every restart trains from step 0: refuse unless there are no restarts or
    the operator allowed it."""
    if has_oracle or allowed or max_restarts == 0:
        return None
    return (f"no resume oracle: after a failure the job would restart from step 0 (up to {max_restarts} times); "
            f"give --ckptd-url URL (or set CKPTD_URL) or --resume-cmd CMD; {OVERRIDE}")


def check_watched(url: str, run_dir: str, run_name: str, timeout: float) -> None:
    """Raise :class:`FreshStartRefused` unless the ckptd at ``url`` watches ``run_dir`` under the
    name ``run_name``; :class:`ckptd.launcher.oracle.OracleUnavailable` while it cannot be asked."""
    if run_name != os.path.basename(run_dir):
        raise FreshStartRefused(f"--run-name {run_name!r} is not the run dir's name {os.path.basename(run_dir)!r}: "
                                f"ckptd names a run by its directory under its root, so it would never find "
                                f"this run's saves; drop --run-name or rename the directory")
    if os.path.islink(run_dir):
        raise FreshStartRefused(f"{run_dir} is a symlink: ckptd never follows links below its root, so it "
                                f"would not see this run's saves; give the real directory under ckptd's root")
    parent = os.path.dirname(run_dir)
    try:
        found = sorted(n for name in os.listdir(parent) if (n := runlayout.node_of_marker(name)) is not None
                       and os.path.isfile(runlayout.node_marker_path(parent, n))
                       and not os.path.islink(runlayout.node_marker_path(parent, n)))
    except OSError as err:
        raise FreshStartRefused(f"cannot list {parent} ({err.strerror}): the run dir must be a directory "
                                f"directly under ckptd serve --root") from None
    rows = get_json(url, "/v1/nodes", timeout)
    known = {str(r.get("name")) for r in rows if isinstance(r, dict)} if isinstance(rows, list) else set()
    if set(found) & known:
        return
    seen = (f"the ckptd node marker(s) there belong to {', '.join(found)}, not to a node of {url} "
            f"({', '.join(sorted(known)) or 'none registered'})") if found else "no ckptd daemon's marker is there"
    raise FreshStartRefused(f"ckptd at {url} does not watch {parent}: {seen}. Start ckptd serve --root {parent} "
                            f"(or put the run dir directly under ckptd's root); {OVERRIDE}")


def refusal_at_start(url: str | None, has_oracle: bool, run_dir: str, run_name: str, max_restarts: int,
                     allowed: bool, patiently: Callable[[Callable[[float], None]], None]) -> tuple[str, str] | None:
    """Both start-up checks, for both launchers: ``(event, reason)`` of why this launch must not
    start -- ``refused``, or ``oracle_error`` when ckptd could not be asked -- None: it may.
    ``patiently(once)`` retries ``once(timeout)`` while ckptd cannot be asked (the launcher's
    ``--oracle-wait`` back-off) and raises OracleError when it gives up."""
    refused = check_oracle(has_oracle, max_restarts, allowed)
    if refused:
        return "refused", refused
    if not url or allowed:
        return None
    try:
        patiently(lambda timeout: check_watched(url, run_dir, run_name, timeout))
    except FreshStartRefused as err:
        return "refused", str(err)
    except OracleError as err:
        return "oracle_error", str(err)
    return None
