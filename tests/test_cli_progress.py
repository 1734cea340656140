"""Progress bars (issue 24): `verify`, `verify --run`, `convert` and `gc` draw one on a terminal and
none when their output is piped or `--json` is given. Real processes: a pseudo-terminal (`pty`)
for the person, pipes for the script; real MindSpore saves catalogued by a real daemon."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from ckptd.settings import Settings
from tests.api_helpers import Server
from tests.daemon_helpers import migrated_sqlite, save_tp_step

#: tqdm's bar: "<desc>: 42%|####      | ..." (the percentage and the bar's left edge)
BAR = re.compile(r"(verify|convert|gc)[^\n\r]*:\s+\d+%\|")


def in_terminal(argv: list[str], env: dict, timeout: float = 180.0) -> tuple[int, str]:
    """Run ``argv`` with stdin, stdout and stderr on a pseudo-terminal of 120 columns: (exit code, all it showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env={**env, "TERM": "xterm"}, close_fds=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            raise AssertionError(f"{argv} did not finish in {timeout}s: {out[-2000:]!r}")
    finally:
        os.close(master)
    return proc.wait(30), out.decode(errors="replace")


def piped(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)


def no_bar(proc: subprocess.CompletedProcess) -> None:
    for stream in (proc.stdout, proc.stderr):
        assert not BAR.search(stream) and "\r" not in stream and "%|" not in stream, stream


@pytest.fixture
def catalogued(ms, root, tmp_path):
    """(env, ckptd argv prefix) with run1's steps 100, 200, 300 saved and verified in a SQLite catalog."""
    db = migrated_sqlite(tmp_path / "catalog.db")
    for step in (100, 200, 300):
        save_tp_step(ms, root, "run1", step)
    with Server(Settings(root=root, db=db, settle_seconds=0.2)) as srv:
        srv.settle()
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_URL"} | {"CKPTD_DB": db, "CKPTD_ROOT": str(root)}
    return env, [sys.executable, "-m", "ckptd"]


def test_verify_shows_progress_on_a_terminal_only(catalogued, root):
    env, ckptd = catalogued
    code, screen = in_terminal([*ckptd, "verify", str(root / "run1")], env)
    assert code == 0 and BAR.search(screen) and "7 valid, 0 invalid" in screen, screen
    pipe = piped([*ckptd, "verify", str(root / "run1")], env)
    assert pipe.returncode == 0 and "7 valid, 0 invalid" in pipe.stdout
    no_bar(pipe)
    as_json = piped([*ckptd, "verify", str(root / "run1"), "--json"], env)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["ok"] is True
    no_bar(as_json)
    # re-verifying the catalogued run: a bar of shards on a terminal, none in a pipe or with --json
    code, screen = in_terminal([*ckptd, "verify", "--run", "run1"], env)
    assert code == 0 and re.search(r"verify run1:\s+\d+%\|", screen) and "6 shards: 6 verified" in screen, screen
    for extra in ([], ["--json"]):
        pipe = piped([*ckptd, "verify", "--run", "run1", *extra], env)
        assert pipe.returncode == 0, pipe.stderr
        no_bar(pipe)
    # --progress asks for the bar in a pipe (on stderr; stdout stays the JSON)
    forced = piped([*ckptd, "verify", "--run", "run1", "--json", "--progress"], env)
    assert forced.returncode == 0 and BAR.search(forced.stderr) and json.loads(forced.stdout)["shards"], forced.stderr


def test_convert_and_gc_show_progress_on_a_terminal_only(catalogued, root, tmp_path):
    env, ckptd = catalogued
    code, screen = in_terminal([*ckptd, "convert", "--run", "run1", "--step", "100", "--to-strategy", "none"], env)
    assert code == 0 and BAR.search(screen) and "every slice verified" in screen, screen
    files = [*ckptd, "convert", "--src", str(root / "run1"), "--src-strategy", str(root / "run1" / "strategy.ckpt"),
             "--to-strategy", "none", "--step", "200"]
    code, screen = in_terminal([*files, "--out", str(tmp_path / "tty")], env)
    assert code == 0 and re.search(r"convert:\s+\d+%\|", screen) and "all verified" in screen, screen
    for out, extra in (("pipe", []), ("json", ["--json"])):
        pipe = piped([*files, "--out", str(tmp_path / out), *extra], env)
        assert pipe.returncode == 0, pipe.stderr
        no_bar(pipe)
    code, screen = in_terminal([*ckptd, "gc", "--run", "run1", "--keep-last", "2"], env)
    assert code == 0 and re.search(r"gc: steps deleted:\s+\d+%\|", screen) and "deleted 1 steps" in screen, screen
    pipe = piped([*ckptd, "gc", "--run", "run1", "--keep-last", "1", "--json"], env)
    assert pipe.returncode == 0 and json.loads(pipe.stdout)["deleted_steps"] == 1, pipe.stderr
    no_bar(pipe)
