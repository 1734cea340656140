"""`ckptd ls` and `ckptd resume` asking a running daemon (--ckptd-url, $CKPTD_URL; issue 24, start-up).

The answers must be the catalog's own either way: the same JSON from the daemon as from the
catalog opened directly, and the resume answer the oracle's. A real `ckptd serve` process, real
MindSpore saves. How fast that is goes in bench/cli_startup.py; here: what it answers and what it
imports (none of the catalog's stack)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.api_helpers import free_port, resume_of, serve_process, stop_process
from tests.daemon_helpers import save_tp_step, wait_for

STEPS = (100, 200)


@pytest.fixture
def served(ms, root, catalog_url, tmp_path):
    """(daemon URL, catalog URL, env) of a `ckptd serve` whose run1 has two verified steps."""
    for step in STEPS:
        save_tp_step(ms, root, "run1", step)
    log = tmp_path / "serve.log"
    proc, client = serve_process(root, catalog_url, log)
    try:
        answer = wait_for(lambda: (a := resume_of(proc, client, log, "run1")) and a["step"] == STEPS[-1] and a,
                          timeout=60, what="the newest step restorable")
        env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_URL", "CKPTD_DB", "CKPTD_TOKEN")}
        yield str(client.base_url), catalog_url, env, answer
    finally:
        client.close()
        stop_process(proc)


def ckptd(env: dict, *argv: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", *argv], capture_output=True, text=True, timeout=120,
                          env={**env, **extra_env})


def test_the_same_answers_from_the_daemon_as_from_the_catalog(served):
    url, db, env, answer = served
    direct = ckptd(env, "resume", "--run", "run1", "--json", "--no-lease", "--db", db, "--no-daemon")
    remote = ckptd(env, "resume", "--run", "run1", "--json", "--no-lease", "--ckptd-url", url)
    by_env = ckptd(env, "resume", "--run", "run1", "--json", "--no-lease", CKPTD_URL=url)
    assert direct.returncode == remote.returncode == by_env.returncode == 0, (direct.stderr, remote.stderr)
    assert remote.stdout == direct.stdout == by_env.stdout  # byte for byte, as the command prints it
    assert json.loads(remote.stdout) == answer  # the oracle's answer (GET /v1/runs/run1/resume)
    # the text form, an older step, a target world size: the same question reaches the oracle
    for args in (["resume", "--run", "run1", "--no-lease"],
                 ["resume", "--run", "run1", "--json", "--no-lease", "--max-step", "150", "--world-size", "1"]):
        d, r = ckptd(env, *args, "--db", db, "--no-daemon"), ckptd(env, *args, "--ckptd-url", url)
        assert d.returncode == r.returncode == 0 and d.stdout == r.stdout, (args, d.stdout, r.stdout, r.stderr)
    assert json.loads(r.stdout)["step"] == 100 and json.loads(r.stdout)["conversion"]["needed"]
    # $CKPTD_URL is set, but --db names a catalog on the command line: that one is read
    assert ckptd(env, "resume", "--run", "run1", "--json", "--no-lease", "--db", db, CKPTD_URL="http://127.0.0.1:9").returncode == 0
    for args in (["ls", "run1"], ["ls", "run1", "--state", "verified"]):
        d, r = ckptd(env, *args, "--db", db, "--no-daemon"), ckptd(env, *args, "--ckptd-url", url)
        assert d.returncode == r.returncode == 0 and d.stdout == r.stdout, (args, d.stdout, r.stdout, r.stderr)
    for args in (["ls", "--json"], ["ls", "run1", "--json"]):  # the API's schema orders a run's keys its own way
        d, r = ckptd(env, *args, "--db", db, "--no-daemon"), ckptd(env, *args, "--ckptd-url", url)
        assert d.returncode == r.returncode == 0 and json.loads(d.stdout) == json.loads(r.stdout), (args, r.stderr)
    runs = ckptd(env, "ls", "--ckptd-url", url)  # the runs table, then the nodes with their liveness
    assert runs.returncode == 0 and "run1" in runs.stdout and "reachable" in runs.stdout, runs.stdout


def test_nothing_restorable_and_errors_through_the_daemon(served):
    url, db, env, _ = served
    for step in STEPS:
        assert ckptd(env, "mark-bad", "--run", "run1", "--step", str(step), "--db", db).returncode == 0
    direct = ckptd(env, "resume", "--run", "run1", "--json", "--no-lease", "--db", db, "--no-daemon")
    remote = ckptd(env, "resume", "--run", "run1", "--json", "--no-lease", "--ckptd-url", url)
    assert direct.returncode == remote.returncode == 1, remote.stderr
    d, r = json.loads(direct.stdout)["detail"], json.loads(remote.stdout)["detail"]
    assert r["code"] == d["code"] == "no_restorable_step" and r["message"] == d["message"]
    assert r["skipped"] == d["skipped"] and {x["step"] for x in r["skipped"]} == set(STEPS)
    text = ckptd(env, "resume", "--run", "run1", "--no-lease", "--ckptd-url", url)
    assert text.returncode == 1 and "skipped step 200" in text.stderr and "has no restorable step" in text.stderr
    # no such run: the catalog's words either way; a daemon that is not there: a clear error, no traceback
    d, r = ckptd(env, "ls", "nope", "--db", db, "--no-daemon"), ckptd(env, "ls", "nope", "--ckptd-url", url)
    assert d.returncode == r.returncode == 1 and d.stderr == r.stderr and "no run named 'nope'" in r.stderr
    gone = ckptd(env, "resume", "--run", "run1", "--json", "--ckptd-url", f"http://127.0.0.1:{free_port()}")
    assert gone.returncode == 1 and "could not be asked" in gone.stderr and "Traceback" not in gone.stderr, gone.stderr
    both = ckptd(env, "ls", "--db", db, "--ckptd-url", url)
    assert both.returncode == 2 and "not both" in both.stderr


PROBE = """
import contextlib, io, json, sys
from ckptd.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print(json.dumps([code, sorted({m.split(".")[0] for m in sys.modules})]))
"""


def test_asking_the_daemon_loads_none_of_the_catalog_stack(served):
    url, _, env, _ = served
    for argv in (["ls"], ["ls", "run1", "--json"], ["resume", "--run", "run1", "--json", "--no-lease"]):
        out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60,
                             env={**env, "CKPTD_URL": url}, check=True)
        code, loaded = json.loads(out.stdout.strip().splitlines()[-1])
        assert code == 0 and not set(loaded) & {"sqlalchemy", "pydantic", "numpy", "alembic", "fastapi"}, (argv, loaded)


def _probe(env: dict, *argv: str, **extra: str) -> tuple[int, set[str]]:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60,
                         env={**env, **extra}, check=True)
    code, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    return code, set(loaded)


def test_the_daemon_serving_the_named_catalog_is_found_without_a_flag(served, tmp_path):
    """`ckptd serve` advertises itself by its catalog (ckptd.advert): `ckptd ls` / `resume` naming that
    catalog -- --db, $CKPTD_DB or the config file -- ask it, with none of the catalog stack loaded,
    and print what the catalog says; a daemon that cannot be asked is skipped for the catalog."""
    url, db, env, _ = served
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(f'db = "{db}"\n')
    for how in ({"argv": ("--db", db)}, {"CKPTD_DB": db}, {"CKPTD_CONFIG": str(cfg)}):
        argv = how.pop("argv", ())
        for cmd in (["ls", "run1", "--json"], ["resume", "--run", "run1", "--json", "--no-lease"]):
            code, loaded = _probe(env, *cmd, *argv, **how)
            assert code == 0 and not loaded & {"sqlalchemy", "pydantic", "numpy"}, (cmd, how, loaded & {"sqlalchemy"})
            found = ckptd(env, *cmd, *argv, **how)
            direct = ckptd(env, *cmd, "--db", db, "--no-daemon")
            assert found.returncode == direct.returncode == 0 and json.loads(found.stdout) == json.loads(direct.stdout)
    # --no-daemon opens the catalog; another catalog is never answered by this daemon
    code, loaded = _probe(env, "ls", "--db", db, "--no-daemon")
    assert code == 0 and "sqlalchemy" in loaded
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert ckptd(env, "db", "upgrade", "--db", other).returncode == 0
    mine = ckptd(env, "ls", "--db", other)
    assert mine.returncode == 0 and "no runs catalogued" in mine.stdout, mine.stdout


def test_an_advertised_daemon_that_does_not_answer_is_skipped_for_the_catalog(ms, root, catalog_url, tmp_path):
    """An advertisement whose process is alive but whose URL answers nothing (a daemon hung, or one we
    hold no token for): the command reads the catalog itself and answers, no error."""
    from ckptd import advert

    save_tp_step(ms, root, "run1", 100)
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_URL", "CKPTD_DB", "CKPTD_TOKEN")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "xdg")
    os.mkdir(env["XDG_RUNTIME_DIR"], 0o700)
    assert ckptd(env, "db", "upgrade", "--db", catalog_url).returncode == 0
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = env["XDG_RUNTIME_DIR"]
    try:
        path = advert.advertise(catalog_url, f"http://127.0.0.1:{free_port()}")  # this test process: alive
        assert advert.find(catalog_url) is not None
    finally:
        os.environ.pop("XDG_RUNTIME_DIR") if old is None else os.environ.__setitem__("XDG_RUNTIME_DIR", old)
    try:
        out = ckptd(env, "ls", "--db", catalog_url)
        assert out.returncode == 0 and "no runs catalogued" in out.stdout and "Traceback" not in out.stderr, out.stderr
    finally:
        os.unlink(path)
