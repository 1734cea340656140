"""Progress bars of the long commands (``verify``, ``convert``, ``gc``): tqdm, for a person only.

A bar is drawn on stderr when both stdout and stderr are a terminal and ``--json`` is not given:
a script reading the output (a pipe, a file, ``--json``) gets none of its text, not even on
stderr, which scripts often capture together with stdout. ``--progress`` (``verify``) asks for a
bar anyway. tqdm is imported only when a bar is drawn: the command's start-up stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

#: ``progress(done, total)``: the callback shape of the services (conversions, re-verification)
Progress = Callable[[int, int], None]


def wanted(args: argparse.Namespace) -> bool:
    if getattr(args, "progress", False):
        return True
    if getattr(args, "json", False):
        return False
    return sys.stdout.isatty() and sys.stderr.isatty()


@contextlib.contextmanager
def bar(args: argparse.Namespace, desc: str, unit: str = "it", total: int | None = None,
        scale: bool = False) -> Iterator[Progress]:
    """A ``progress(done, total)`` callback drawing one bar (or doing nothing, see :func:`wanted`).
    Callable from any thread (a conversion reports from its workers); ``scale``: ``unit`` is bytes
    (shown as KiB/MiB/GiB with a rate)."""
    if not wanted(args):
        yield lambda done, total: None
        return
    from tqdm import tqdm

    lock = threading.Lock()
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
              file=sys.stderr, dynamic_ncols=True, leave=False) as t:
        def progress(done: int, total_now: int) -> None:
            with lock:
                if t.total != total_now:
                    t.total = total_now
                    t.refresh()
                t.update(done - t.n)

        yield progress
