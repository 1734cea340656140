"""`ckptd --help` starts without the heavy libraries (issue 24, start-up): they are imported only by
the commands that use them. Timing is bench/cli_startup.py's job; this checks what is imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("fastapi", "sqlalchemy", "numpy", "pydantic", "cryptography", "uvicorn", "mindspore", "prometheus_client")
PROBE = """
import contextlib, io, json, sys
from ckptd.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


@pytest.mark.parametrize("argv", [["--help"], [], ["inspect", "--help"], ["convert", "--help"], ["launch", "--help"]])
def test_help_imports_no_heavy_library(argv):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
