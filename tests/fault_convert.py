"""Run the ``ckptd`` CLI in this process with a conversion that stops itself half-way.

``python -m tests.fault_convert FRACTION SIGNAL -- <ckptd arguments>``: once FRACTION of a
conversion's output is written, the process sends itself SIGNAL (``STOP``, ``KILL``): a real
``ckptd serve`` / ``ckptd convert`` caught mid-conversion, its temp tree half full, at a point no
outside observer could hit reliably. The fault lives here, in the test harness, wrapped around
ckptd's public ``ckptd.convert.convert``; production code carries no hook for it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _signal_at(fraction: float, signum: int):
    import ckptd.convert

    real = ckptd.convert.convert
    fired, lock = [False], threading.Lock()

    def convert(*args, progress=None, **kwargs):
        def tick(done: int, total: int) -> None:
            if progress is not None:
                progress(done, total)
            with lock:
                if fired[0] or not total or done < fraction * total:
                    return
                fired[0] = True
            os.kill(os.getpid(), signum)

        return real(*args, progress=tick, **kwargs)

    ckptd.convert.convert = convert


def main(argv: list[str]) -> int:
    fraction, name, sep, *rest = argv
    assert sep == "--", "usage: python -m tests.fault_convert FRACTION SIGNAL -- <ckptd arguments>"
    _signal_at(float(fraction), getattr(signal, f"SIG{name}"))
    from ckptd.cli import main as ckptd_main

    return ckptd_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
