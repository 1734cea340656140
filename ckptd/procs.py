"""Is this process alive? -- the one answer for the service (jobs' owners, conversions' temp trees),
the conversion engine and the launcher (ranks, their process tree). Imports nothing of ckptd.

A pid alone is not a process: it can be a zombie (exited, not reaped: ``kill(pid, 0)`` still
succeeds) or belong to a newer process after reuse. So, where ``/proc`` exists (Linux), a process
is alive when ``/proc/<pid>/stat`` exists, its state is not zombie/dead, and -- when the caller
recorded it -- its start time is the recorded one. Elsewhere only ``kill(pid, 0)`` can be asked
(a process we may not signal exists: alive).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_PROC = "/proc"


@dataclass(frozen=True)
class ProcStat:
    state: str  # the state letter: R, S, D, Z (zombie), X (dead), ...
    ppid: int
    start: int  # start time in clock ticks since boot


def stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` of a pid on this machine, None when there is no such process (or no /proc)."""
    try:
        with open(f"{_PROC}/{int(pid)}/stat", encoding="ascii", errors="replace") as fh:
            raw = fh.read()
    except (OSError, ValueError):
        return None
    if ")" not in raw:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 on; comm may hold spaces and ")"
    try:
        return ProcStat(fields[0], int(fields[1]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def why_gone(pid: int, start: int | None = None) -> str | None:
    """Why the process ``pid`` (started at ``start``, when known) is certainly not running; None
    while it is."""
    if pid <= 0:
        return "is not running"
    if not os.path.isdir(f"{_PROC}/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "is not running"
        except OSError:
            pass  # exists, owned by someone else
        return None
    st = stat(pid)
    if st is None:
        return "is not running"
    if st.state in ("Z", "X"):
        return "has exited"
    if start is not None and st.start != start:
        return "is not running (the pid belongs to a newer process)"
    return None


def alive(pid: int, start: int | None = None) -> bool:
    return why_gone(pid, start) is None


def children() -> dict[int, list[int]]:
    """Every process of this machine by its parent's pid (Linux: /proc; elsewhere empty)."""
    out: dict[int, list[int]] = {}
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit() and (st := stat(int(entry))) is not None:
            out.setdefault(st.ppid, []).append(int(entry))
    return out
