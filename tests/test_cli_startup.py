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


def test_inspect_reads_a_file_without_numpy(tmp_path):
    """`ckptd inspect` of a MindSpore-style file (a tensor and append_dict scalars) loads no numpy,
    SQLAlchemy or pydantic:
    the index, the CRC and the scalars' values are read without it."""
    import numpy as np

    from ckptd.format.checkpoint import write_checkpoint

    path = tmp_path / "net-1_10.ckpt"
    write_checkpoint(path, [("w", np.arange(64, dtype=np.float32)), ("epoch_num", np.array(3, np.int64)),
                            ("lr", np.array(0.25, np.float32)), ("scale", np.array(1.5, np.float16))], crc=True)
    out = subprocess.run([sys.executable, "-c", PROBE, "inspect", str(path), "--json"], capture_output=True, text=True,
                         timeout=60, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    # cryptography stays: the reader sniffs encryption before it knows the file is plain (~10 ms here)
    assert not loaded & (set(HEAVY) - {"cryptography"}), sorted(loaded & set(HEAVY))
    doc = subprocess.run([sys.executable, "-m", "ckptd", "inspect", str(path), "--json"], capture_output=True, text=True,
                         timeout=60, check=True)
    values = {e["name"]: e.get("value") for e in json.loads(doc.stdout)["entries"]}
    assert values == {"w": None, "epoch_num": 3, "lr": 0.25, "scale": 1.5}  # what numpy's .item() gives


def test_the_quick_schema_head_is_alembics():
    """The schema guard's shortcut (the migration files' revision lines) names alembic's head."""
    from ckptd.catalog.db import head_revision, quick_head

    assert quick_head() == head_revision()
