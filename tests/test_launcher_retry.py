"""The launcher when ckptd is briefly down (issue 15, finding 13): it waits with back-off, says so, and
carries on once ckptd answers -- with a real ``ckptd serve`` that starts only after the launcher began
asking, and one SIGKILLed (and restarted) while a restart of the job waits for its answer.

Only "cannot be asked" is waited for (no connection, timeout, 5xx): a definite answer (404
no_restorable_step / not_found) is acted on at once, and an answer that is not one (not JSON, a
refused token) stops the launcher at once. ``--oracle-fallback scan`` resumes from the launcher's own
scan of the run directory when ckptd stays away, never from a save of another layout.
"""

from __future__ import annotations

import http.server
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests import trainer_helpers as th
from tests.daemon_helpers import wait_for
from trainer.oracle import OracleError, OracleUnavailable, ask_http, check_ready, wait_settled
from tests.api_helpers import free_port, stop_process

STEPS = th.SAVES_3_6_8  # saves at steps 3, 6, 8; the shared reference run (conftest) is of these
TOKEN = "retry-report-token"


class Serve:
    """``ckptd serve`` as its own process on a fixed port, stoppable (SIGKILL) and restartable on the
    same catalog, as test_e2e.py starts it."""

    def __init__(self, base: Path, port: int) -> None:
        self.base, self.port = base, port
        self.root = base / "root"
        self.root.mkdir(parents=True, exist_ok=True)
        self.db = f"sqlite:///{base / 'catalog.db'}"
        self.tokens = base / "tokens"
        self.tokens.write_text(f"report {TOKEN}\n")
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        subprocess.run([sys.executable, "-m", "ckptd", "db", "upgrade", "--db", self.db], cwd=th.REPO, env=th.env(),
                       check=True, capture_output=True)

    def start(self) -> None:
        self.starts += 1
        env = dict(th.env(), CKPTD_TOKEN_FILE=str(self.tokens))
        with open(self.base / f"ckptd.{self.starts}.log", "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(self.root), "--port",
                                          str(self.port), "--db", self.db], cwd=th.REPO, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)

    def up(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"ckptd serve exited {self.proc.returncode}"
        try:
            r = httpx.get(f"{self.url}/healthz", timeout=2)
            return r.status_code == 200 and bool(r.json().get("first_rescan_done"))
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def serve(tmp_path):
    s = Serve(tmp_path / "ckptd", free_port())
    yield s
    s.stop()


class Launcher:
    """The real launcher as a background process; its decisions are read from ``launcher.log``."""

    def __init__(self, run_dir: Path, url: str, *launch_args: str, faults: tuple[str, ...] = (),
                 train_args: tuple[str, ...] = tuple(STEPS), tp: int = 2, dp: int = 1) -> None:
        self.run_dir = run_dir
        cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(run_dir), "--tp", str(tp), "--dp", str(dp),
               "--ckptd-url", url, *launch_args]
        for f in faults:
            cmd += ["--fault", f]
        cmd += ["--", *th.TINY, *train_args]
        env = dict(th.env(), CKPTD_TOKEN=TOKEN)
        self.proc = subprocess.Popen(cmd, cwd=th.REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.t0 = time.monotonic()

    def lines(self) -> list[str]:
        try:
            text = (self.run_dir / "launcher.log").read_text()
        except OSError:
            return []
        return [line.split(" ", 1)[1] for line in text.splitlines() if " " in line]

    def count(self, needle: str) -> int:
        return sum(needle in line for line in self.lines())

    def wait(self, timeout: float = 400) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
            raise AssertionError("launcher did not finish:\n" + "\n".join(self.lines())) from None
        return self.proc.returncode, "\n".join(l for l in err.splitlines() if l.startswith("launch:"))


@pytest.fixture(scope="module")
def ref(uninterrupted_tp2):
    """The same job without any failure or ckptd (the stand-in oracle is never asked)."""
    return uninterrupted_tp2


def assert_same_losses_and_shards(ref_dir: Path, got_dir: Path, final: int = 8) -> None:
    ref, got = th.losses(ref_dir), th.losses(got_dir)
    assert sorted(got) == list(range(1, final + 1))
    for step, entries in got.items():
        assert {h for _, h in entries} == {ref[step][0][1]}, f"loss of step {step} differs from the uninterrupted run"
    for r in range(2):
        assert th.read(th.shard(got_dir, r, final)) == th.read(th.shard(ref_dir, r, final)), f"rank {r} step {final}"


# --- a real ckptd serve, down while the launcher asks ----------------------------------------------


def test_first_start_waits_for_ckptd_that_comes_up_later(serve):
    """Nothing listens yet when the launcher first asks: it waits (one line per wait) instead of
    exiting 2, and once ckptd is up it takes ckptd's definite answer (run not catalogued: fresh start)."""
    run_dir = serve.root / "late"
    launcher = Launcher(run_dir, serve.url, "--oracle-backoff", "0.3", "--oracle-backoff-max", "1",
                        train_args=("--steps", "3", "--save-every", "3", "--micro-batch", "4"))
    wait_for(lambda: launcher.proc.poll() is not None or launcher.count("event=oracle-wait") >= 3, timeout=60,
             what="the launcher to wait for ckptd")
    assert launcher.proc.poll() is None, "launcher gave up while ckptd was down:\n" + "\n".join(launcher.lines())
    serve.start()
    wait_for(serve.up, timeout=60, interval=0.2, what="ckptd serve to come up")
    rc, log = launcher.wait()
    assert rc == 0, log
    waits = [l for l in log.splitlines() if "event=oracle-wait" in l]
    assert len(waits) >= 3
    assert waits[0].startswith("launch: attempt=0 event=oracle-wait tries=1 ") and "deadline=120s" in waits[0]
    assert "ckptd unreachable" in waits[0] and "refused" in waits[0].lower()
    assert [int(l.split("tries=")[1].split()[0]) for l in waits] == list(range(1, len(waits) + 1))
    assert "attempt=0 event=oracle_reached" in log
    assert "attempt=0 event=fresh_start step=0" in log and "run not in the catalog yet" in log
    assert "attempt=0 event=finished" in log and "oracle_error" not in log


@pytest.mark.slow
def test_restart_waits_while_ckptd_is_killed_and_restarted(serve, ref):
    """The job loses a rank; just then ckptd is SIGKILLed. The restart waits for ckptd -- which comes
    back, is SIGKILLed once more before it is ready, and comes back again on the same catalog -- and
    then resumes from ckptd's verified step, bit for bit the uninterrupted run."""
    serve.start()
    wait_for(serve.up, timeout=60, interval=0.2, what="ckptd serve to come up")
    run_dir = serve.root / "flap"
    launcher = Launcher(run_dir, serve.url, "--backoff", "3", "--oracle-backoff", "0.5", "--oracle-backoff-max", "2",
                        faults=("kill:1:8",))
    wait_for(lambda: launcher.proc.poll() is not None or launcher.count("event=rank_failed"), timeout=300,
             interval=0.02, what="the injected rank failure")
    serve.kill()  # within the launcher's 3 s back-off: its question finds nobody
    wait_for(lambda: launcher.proc.poll() is not None or launcher.count("attempt=1 event=oracle-wait") >= 2,
             timeout=60, what="the restart to wait for ckptd")
    assert launcher.proc.poll() is None, "launcher gave up while ckptd was down:\n" + "\n".join(launcher.lines())
    serve.start()
    time.sleep(1.0)
    serve.kill()  # SIGKILLed again while still starting
    before = launcher.count("attempt=1 event=oracle-wait")
    wait_for(lambda: launcher.count("attempt=1 event=oracle-wait") > before, timeout=30,
             what="another wait after the second SIGKILL")
    serve.start()
    rc, log = launcher.wait()
    assert rc == 0, log
    assert "attempt=0 event=rank_failed rank=1 step=8" in log
    assert "attempt=1 event=oracle_reached" in log
    assert "attempt=1 event=resume step=6" in log, log
    assert "attempt=1 event=finished" in log and "oracle_error" not in log
    assert_same_losses_and_shards(ref, run_dir)


# --- what is waited for and what is not (a stand-in HTTP server, no MindSpore) ---------------------


class Canned(http.server.BaseHTTPRequestHandler):
    status, body = 200, b""
    hits = 0  # questions to the resume oracle (the settle wait asks for the run's steps too)

    def do_GET(self) -> None:
        type(self).hits += self.path.split("?")[0].endswith("/resume")
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def canned():
    servers = []

    def make(status: int, body: bytes) -> str:
        handler = type("H", (Canned,), {"status": status, "body": body, "hits": 0})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        make.handler = handler
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield make
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_ask_http_tells_unavailable_from_definite_and_malformed(canned):
    with pytest.raises(OracleUnavailable, match="unreachable"):
        ask_http(f"http://127.0.0.1:{free_port()}", "r", 2)
    for status in (500, 502, 503, 504, 429):
        with pytest.raises(OracleUnavailable, match=f"HTTP {status}"):
            ask_http(canned(status, b"{}"), "r", 2)
    assert ask_http(canned(404, b'{"detail": {"code": "no_restorable_step"}}'), "r", 2).step is None
    assert ask_http(canned(404, b'{"detail": {"code": "not_found"}}'), "r", 2).step is None
    for status, body in ((200, b"<html>"), (200, b"[1]"), (200, b'{"step": 1}'), (401, b"{}"), (403, b"{}"),
                         (404, b"not ckptd")):
        with pytest.raises(OracleError) as err:
            ask_http(canned(status, body), "r", 2)
        assert not isinstance(err.value, OracleUnavailable), (status, body)


def test_a_ckptd_still_in_its_first_rescan_is_waited_for(canned):
    """Until its first rescan is done a restarted ckptd does not know what changed on disk while it was down."""
    with pytest.raises(OracleUnavailable, match="first rescan"):
        check_ready(canned(200, b'{"status": "ok", "first_rescan_done": false}'))
    check_ready(canned(200, b'{"status": "ok", "first_rescan_done": true}'))
    check_ready(canned(503, b'{"status": "stalled", "first_rescan_done": true}'))  # the resume answer decides
    check_ready(canned(200, b"{}"))  # a ckptd without the field
    with pytest.raises(OracleUnavailable, match="unreachable"):
        check_ready(f"http://127.0.0.1:{free_port()}")


def test_the_settled_barrier_tells_unavailable_from_refused_and_malformed(canned):
    """A ckptd that cannot be asked is reported at once (the launcher's back-off waits for it, and
    logs it), not waited for inside the barrier; a refused token or a non-answer stops at once."""
    # an hour's timeout: the raise can only come from the first refused connection, not the deadline
    with pytest.raises(OracleUnavailable, match="unreachable"):
        wait_settled(f"http://127.0.0.1:{free_port()}", "run", timeout=3600)
    for status in (500, 503):
        with pytest.raises(OracleUnavailable, match=f"HTTP {status}"):
            wait_settled(canned(status, b"{}"), "run", timeout=30)
    for status, body in ((401, b"{}"), (403, b"{}"), (404, b"not ckptd"), (200, b"<html>"), (200, b"[1]"),
                         (200, b'{"settled": true}')):
        with pytest.raises(OracleError) as err:
            wait_settled(canned(status, body), "run", timeout=30)
        assert not isinstance(err.value, OracleUnavailable), (status, body)


def _launch_quick(run_dir: Path, url: str, *launch_args: str, tp: int = 2, dp: int = 1) -> tuple[int, str, float]:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(run_dir), "--tp", str(tp), "--dp", str(dp),
           "--ckptd-url", url, *launch_args, "--", *th.TINY, *STEPS]
    proc = subprocess.run(cmd, cwd=th.REPO, env=th.env(), capture_output=True, text=True, timeout=300, check=False)
    log = "\n".join(l for l in proc.stderr.splitlines() if l.startswith("launch:"))
    return proc.returncode, log, time.monotonic() - t0


def test_ckptd_that_stays_unavailable_is_given_up_on_after_the_deadline(canned, tmp_path):
    url = canned(503, b'{"detail": "starting"}')
    rc, log, took = _launch_quick(tmp_path / "run", url, "--oracle-wait", "4", "--oracle-backoff", "0.2")
    assert rc == 2, log
    waits = [l for l in log.splitlines() if "event=oracle-wait" in l]
    assert len(waits) >= 3 and "ckptd answered HTTP 503" in waits[0] and "deadline=4s" in waits[0]
    # back-off doubles: 0.2, 0.4, 0.8, ... (the last wait is cut to the deadline)
    assert [l.split("next=")[1].split()[0] for l in waits[:3]] == ["0.20s", "0.40s", "0.80s"]
    last = log.splitlines()[-1]
    assert "event=oracle_error" in last and "HTTP 503" in last and "--oracle-wait 4s" in last
    assert 4 <= took < 60 and "event=started" not in log


def test_a_malformed_answer_stops_at_once(canned, tmp_path):
    url = canned(200, b"this is not ckptd")
    rc, log, _ = _launch_quick(tmp_path / "run", url, "--oracle-wait", "60")
    assert rc == 2 and "event=oracle-wait" not in log, log
    assert "event=oracle_error" in log and "malformed answer" in log
    # the first question (does this ckptd watch the run dir? GET /v1/nodes) got the nonsense: the
    # resume question was never reached
    assert canned.handler.hits == 0 and "/v1/nodes" in log


def test_fallback_scan_resumes_from_the_local_scan(ref, tmp_path):
    """ckptd stays away; with --oracle-fallback scan the launcher resumes from the newest save whose
    shards match their sidecars (here step 6: step 8's were removed), bit for bit."""
    run_dir = tmp_path / "run"
    shutil.copytree(ref, run_dir, ignore=shutil.ignore_patterns("launcher*", "heartbeat", "metrics.jsonl"))
    for r in range(2):
        for suffix in ("", ".done"):
            os.chmod(th.shard(run_dir, r, 8) + suffix, 0o600)
            os.unlink(th.shard(run_dir, r, 8) + suffix)
    url = f"http://127.0.0.1:{free_port()}"
    rc, log, _ = _launch_quick(run_dir, url, "--oracle-wait", "1", "--oracle-backoff", "0.2",
                               "--oracle-fallback", "scan")
    assert rc == 0, log
    assert "attempt=0 event=oracle-fallback using=scan" in log
    assert "attempt=0 event=resume step=6 reason=\"local scan: newest restorable step 6\"" in log
    got = th.losses(run_dir)
    assert sorted(got) == [7, 8]
    refl = th.losses(ref)
    assert all({h for _, h in got[s]} == {refl[s][0][1]} for s in got)
    for r in range(2):
        assert th.read(th.shard(run_dir, r, 8)) == th.read(th.shard(ref, r, 8))


def test_fallback_scan_never_hands_over_a_save_of_another_layout(ref, tmp_path):
    """The same files under a tp=1,dp=2 job (same world size): the scan finds a whole step 8, but its
    shards are tp=2's -- only ckptd can re-shard, so the launcher stops instead of training on them."""
    run_dir = tmp_path / "run"
    shutil.copytree(ref, run_dir, ignore=shutil.ignore_patterns("launcher*", "heartbeat", "metrics.jsonl"))
    rc, log, _ = _launch_quick(run_dir, f"http://127.0.0.1:{free_port()}", "--oracle-wait", "0.5",
                               "--oracle-backoff", "0.2", "--oracle-fallback", "scan", tp=1, dp=2)
    assert rc == 2, log
    assert "event=oracle-fallback" in log and "event=oracle_error" in log
    assert "shard of tp=2,dp=1, this job is rank 0 of tp=1,dp=2; only ckptd can re-shard it" in log
    assert "event=started" not in log


def test_an_answer_that_does_not_echo_the_split_is_never_used_for_one(canned, tmp_path):
    """A ckptd older than the launcher ignores ``?split=`` and calls a step of the same world size
    but another tp/dp split fine as it is: the launcher refuses the answer rather than hand the job
    shards of another layout; the same answer echoing the split is used."""
    import json

    from ckptd.launcher.command import LaunchSpec, ask
    from ckptd.launcher.oracle import ConversionError
    from ckptd.launcher.supervise import Log
    from ckptd.split import ParallelSplit

    body = {"run": "r", "step": 6, "world_size": 2, "strategy_hash": "sha256:" + "0" * 64, "conversion": None,
            "shards": [{"rank": 0, "path": "/ckpt/rank_0/net-1_6.ckpt"}, {"rank": 1, "path": "/ckpt/rank_1/net-1_6.ckpt"}]}
    for echoed in (None, "tp=1,dp=2"):
        url = canned(200, json.dumps(body | ({"split": echoed} if echoed else {})).encode())
        spec = LaunchSpec(["true"], str(tmp_path), 2, "r", ckptd_url=url, split=ParallelSplit(1, 2), settle_timeout=0,
                          oracle_wait=0)
        if echoed is None:
            with pytest.raises(ConversionError, match=r"did not answer for the split tp=1,dp=2 \(it is older"):
                ask(spec, 0, Log(str(tmp_path / "launcher.log")))
        else:
            assert ask(spec, 0, Log(str(tmp_path / "launcher.log"))).step == 6
