"""Run the ``ckptd`` CLI in this process with conversions that never finish on their own.

``python -m tests.slow_convert MODE -- <ckptd arguments>``: at a conversion's first progress report
(some output is written: the temp tree holds part of a rank) the converting thread stays there:

* ``report`` -- it reports the same progress again every 50 ms, for ever: a long conversion that is
  alive (a slow disk), which stops only when its job is stopped (cancel, shutdown) at a report;
* ``wedge`` -- it blocks without reporting: a read on a hung file system, which nothing can stop.

Its marker file (``$CKPTD_TEST_SLOW_MARKER``) is written once the conversion is held, so a test
knows, without a timing guess, that the job is running mid-conversion. Like
:mod:`tests.fault_convert`, the fault lives in the test harness, wrapped around ckptd's public
``ckptd.convert.convert``; production code carries no hook for it.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def _hold(mode: str) -> None:
    import ckptd.convert

    real = ckptd.convert.convert
    marker = os.environ["CKPTD_TEST_SLOW_MARKER"]

    def convert(*args, progress=None, **kwargs):
        def tick(done: int, total: int) -> None:
            if progress is not None:
                progress(done, total)
            if done >= total:
                return
            with open(marker, "a") as fh:
                fh.write(f"{mode} {done}/{total}\n")
            if mode == "wedge":
                threading.Event().wait()
            while True:  # report: the runner's progress raises once the job is to stop
                time.sleep(0.05)
                if progress is not None:
                    progress(done, total)

        return real(*args, progress=tick, **kwargs)

    ckptd.convert.convert = convert


def main(argv: list[str]) -> int:
    mode, sep, *rest = argv
    assert sep == "--" and mode in ("report", "wedge"), "usage: python -m tests.slow_convert report|wedge -- <ckptd arguments>"
    _hold(mode)
    from ckptd.cli import main as ckptd_main

    return ckptd_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
