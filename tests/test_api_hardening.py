"""Hostile input to the REST API and to ``ckptd serve`` (issue 15, findings 5, 7, 9, 10, 11).

Real servers throughout: uvicorn in a thread (tests.api_helpers.Server) on SQLite and PostgreSQL,
and ``ckptd serve`` processes for the command line's own checks.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from ckptd.settings import ConfigError, Settings
from tests.api_helpers import Server, free_port
from tests.daemon_helpers import migrated_sqlite, query, save_shard, write_tp_strategy

TOKENS = {"r-token": "read", "p-token": "report", "a-token": "admin"}
REPO = Path(__file__).resolve().parent.parent
MiB = 2**20


@pytest.fixture
def server(root, catalog_url):
    settings = Settings(root=root, db=catalog_url, settle_seconds=0.1, rescan_interval=3600, tokens=TOKENS)
    with Server(settings) as srv:
        yield srv


@pytest.fixture
def sqlite_server(root, tmp_path):

    url = migrated_sqlite(tmp_path / "catalog.db")
    with Server(Settings(root=root, db=url, settle_seconds=0.1, rescan_interval=3600, tokens=TOKENS)) as srv:
        yield srv


def _job(ms, root, steps=(100, 200, 300)):
    write_tp_strategy(root / "run1")
    for step in steps:
        for rank in range(2):
            save_shard(ms, root, "run1", rank, step)


def _ckptd(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))


# --- finding 5: bodies are capped per route, and authentication comes before reading one ---------


class _PeakRss:
    """Peak resident memory of this process (the in-process server's) while the block runs."""

    def __enter__(self) -> "_PeakRss":
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def grown(self) -> int:
        return self.peak - self.base


def _stream_post(port: int, path: str, total: int, *, token: str | None, chunked: bool) -> tuple[int, int]:
    """POST a ``total``-byte JSON body (one huge string field) the way a client streams an upload,
    reading the answer as soon as the server sends one (as curl does). (status, body bytes sent)."""
    head = b'{"step": 1, "loss": 1.0, "pad": "'
    tail = b'"}'
    fill = b"x" * MiB
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}")

    def pieces():
        yield head
        left = total - len(head) - len(tail)
        while left > 0:
            n = min(left, len(fill))
            yield fill[:n]
            left -= n
        yield tail

    def framed():
        for piece in pieces():
            yield (b"%x\r\n" % len(piece) + piece + b"\r\n") if chunked else piece
        if chunked:
            yield b"0\r\n\r\n"

    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        sock.setblocking(False)
        source, pending, sent = framed(), b"", 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock] if pending or source else [], [], 1.0)
            if readable:
                break  # the server answered: stop sending, as a client does
            if writable:
                if not pending:
                    pending = next(source, b"")
                    if not pending:
                        source = None
                        continue
                try:
                    n = sock.send(pending)
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent, pending = sent + n, pending[n:]
        sock.setblocking(True)
        sock.settimeout(60)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return int(answer.split(b" ", 2)[1]), sent
    finally:
        sock.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_300mb_post_without_a_token_is_refused_before_it_is_read(root, sqlite_server, chunked):
    (root / "run1").mkdir()
    with _PeakRss() as rss:
        status, sent = _stream_post(sqlite_server.port, "/v1/runs/run1/health", 300 * MiB, token=None, chunked=chunked)
    print(f"no token, 300 MiB {'chunked' if chunked else 'declared'}: {status} after {sent / MiB:.1f} MiB sent, "
          f"RSS +{rss.grown / MiB:.1f} MiB")
    assert status == 401
    assert sent < 64 * MiB  # the server stopped reading (what was sent sits in socket buffers)
    assert rss.grown < 32 * MiB


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_300mb_post_with_a_token_gets_413_without_memory_growth(root, sqlite_server, chunked):
    (root / "run1").mkdir()
    with _PeakRss() as rss:
        status, sent = _stream_post(sqlite_server.port, "/v1/runs/run1/steps/1/mark-bad", 300 * MiB, token="a-token",
                                    chunked=chunked)
    print(f"admin token, 300 MiB {'chunked' if chunked else 'declared'}: {status} after {sent / MiB:.1f} MiB sent, "
          f"RSS +{rss.grown / MiB:.1f} MiB")
    assert status == 413
    assert sent < 64 * MiB and rss.grown < 32 * MiB


def test_body_limits_are_per_route_and_documented(ms, root, sqlite_server):
    _job(ms, root, steps=(100,))
    sqlite_server.settle()
    admin, reporter = sqlite_server.client("a-token"), sqlite_server.client("p-token")
    json_headers = {"content-type": "application/json"}
    # mark-bad: 64 KiB; a 2000-character reason is far below it
    assert admin.post("/v1/runs/run1/steps/100/mark-bad", json={"reason": "r" * 2000}).status_code == 200
    big = json.dumps({"reason": "r" * (64 * 1024)}).encode()
    r = admin.post("/v1/runs/run1/steps/100/mark-bad", content=big, headers=json_headers)
    assert r.status_code == 413 and r.json()["detail"]["code"] == "payload_too_large"

    def chunks():  # no Content-Length: counted while it arrives
        yield big[:40000]
        yield big[40000:]

    r = admin.post("/v1/runs/run1/steps/100/mark-bad", content=chunks(), headers=json_headers)
    assert r.status_code == 413, r.text
    # health reports: 4 KiB (whitespace is JSON too)
    ok = b'{"step": 5, "loss": 1.5}' + b" " * 3000
    assert reporter.post("/v1/runs/run1/health", content=ok, headers=json_headers).status_code == 204
    r = reporter.post("/v1/runs/run1/health", content=ok + b" " * 2000, headers=json_headers)
    assert r.status_code == 413
    # a request without a token is refused first, whatever its size
    r = sqlite_server.client().post("/v1/runs/run1/health", content=ok + b" " * 2000, headers=json_headers)
    assert r.status_code == 401
    doc = sqlite_server.client().get("/openapi.json").json()
    assert doc["paths"]["/v1/runs/{run}/health"]["post"]["x-max-body-bytes"] == 4096
    assert doc["paths"]["/v1/runs/{run}/steps/{step}/mark-bad"]["post"]["x-max-body-bytes"] == 64 * 1024


# --- finding 7: out-of-range numbers and NUL characters are 4xx, and the document says so --------

BIG = 2**63  # one above int64
_REQUESTS = [
    ("post", "/v1/runs/run1/steps/9223372036854775808/pin", None, 422),
    ("post", "/v1/runs/run1/steps/99999999999999999999999999/unpin", None, 422),
    ("get", "/v1/runs/run1/steps/9223372036854775807", None, 404),  # the largest step there can be
    ("get", "/v1/runs/run1/steps/9223372036854775808/shards", None, 422),
    ("post", "/v1/runs/run1/steps/9223372036854775807/mark-bad", {"reason": "x"}, 404),
    ("get", "/v1/jobs/2147483648", None, 422),  # job ids are PostgreSQL int4
    ("get", "/v1/jobs/2147483647", None, 404),
    ("get", "/v1/jobs/-1", None, 422),
    ("get", f"/v1/runs/run1/resume?max_step={BIG}", None, 422),
    ("get", "/v1/runs/run1/resume?world_size=2147483648", None, 422),
    ("get", "/v1/runs/run1/resume?world_size=2147483647", None, 200),
    ("get", "/v1/runs/run1/resume?skip_spikes=true&spike_window=2147483648", None, 422),
    ("get", "/v1/runs/run1/resume?skip_spikes=true&spike_factor=inf", None, 422),
    ("get", "/v1/runs/run1/resume?max_stpe=10", None, 422),  # a misspelt parameter is not ignored
    ("post", "/v1/runs/run1/health", {"step": BIG, "loss": 1.0}, 422),
    ("post", "/v1/runs/run1/verify", {"step": BIG}, 422),
    ("post", "/v1/runs/run1/conversions", {"step": BIG, "to_layout": "tp=1,dp=1"}, 422),
    # a bad to_layout is 400 from the job's own parser (ckptd.convert.layouts), with what is wrong
    ("post", "/v1/runs/run1/conversions", {"step": 100, "to_layout": "tp=99999999999999999999"}, 400),
    ("post", "/v1/runs/run1/gc", {"keep_last": BIG}, 422),
    ("post", "/v1/runs/run1/steps/100/mark-bad", {"reason": "bad\u0000step"}, 422),
    ("post", "/v1/runs/run1/conversions", {"step": 100, "to_strategy": "run1/strategy.ckpt\u0000"}, 422),
    ("get", "/v1/runs/run1/steps?state=%00", None, 400),
    ("get", "/v1/runs/run%001/steps", None, 400),
    ("delete", f"/v1/runs/run1/health?from_step={BIG}", None, 422),
]


def test_out_of_range_values_and_nul_characters_are_answered_4xx(ms, root, server):
    _job(ms, root, steps=(100,))
    server.settle()
    admin = server.client("a-token")
    got = []
    for method, path, body, _ in _REQUESTS:
        r = admin.request(method.upper(), path, json=body) if body is not None else admin.request(method.upper(), path)
        got.append(r.status_code)
        assert r.headers["content-type"] == "application/json"
        if r.status_code >= 400:
            assert set(r.json()["detail"]) >= {"code", "message", "hint"}, r.text
    assert got == [expect for *_, expect in _REQUESTS], [
        (m, p, g) for (m, p, _, e), g in zip(_REQUESTS, got) if g != e]
    assert [n for (n,) in query(server.app.state.settings.db, "SELECT count(*) FROM checkpoints WHERE marked_bad")] == [0]


def test_the_openapi_document_describes_what_the_server_returns(root, sqlite_server):
    doc = sqlite_server.client().get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert doc["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": doc["components"]["securitySchemes"]["HTTPBearer"]["description"]}
    error_ref = {"$ref": "#/components/schemas/ErrorOut"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            where = f"{method.upper()} {path}"
            for code, answer in op["responses"].items():
                if (where, code) == ("GET /healthz", "503"):  # a stalled daemon answers its health body
                    assert answer["content"] == {"application/json": {"schema": {"$ref": "#/components/schemas/HealthzOut"}}}
                elif code.startswith(("4", "5")):
                    assert answer["content"] == {"application/json": {"schema": error_ref}}, where
            assert "422" in codes, where
            if op.get("security"):
                assert {"401", "403"} <= codes, where
            if method != "get":
                assert "413" in codes and op["x-max-body-bytes"] > 0, where
            for p in op.get("parameters", []):
                if p["name"] == "run":
                    assert p["schema"]["pattern"].endswith("$") and p["schema"]["maxLength"] == 255, where
                    assert "400" in codes and "404" in codes, where
                if p["name"] == "step" and p["in"] == "path":
                    assert (p["schema"]["minimum"], p["schema"]["maximum"]) == (0, 2**63 - 1), where
                if p["name"] == "job_id":
                    assert (p["schema"]["minimum"], p["schema"]["maximum"]) == (1, 2**31 - 1), where
    # no 5xx is ever documented, but /healthz's 503 (a stalled worker, for supervisors and load balancers)
    assert [(path, c) for c in map(str, range(500, 600)) for path, ops in doc["paths"].items() for op in ops.values()
            if c in op["responses"]] == [("/healthz", "503")]
    # the framework's own errors come in the same body
    r = sqlite_server.client("a-token").get("/v1/nowhere")
    assert r.status_code == 404 and r.json()["detail"]["code"] == "not_found"
    r = sqlite_server.client("a-token").put("/v1/runs")
    assert r.status_code == 405 and r.json()["detail"]["code"] == "method_not_allowed"


# --- finding 9: a run name never ends in a newline -------------------------------------------------


@pytest.mark.parametrize("name", ["run1%0A", "run1%0D%0A", "%0Arun1"])
def test_run_names_with_control_characters_are_refused(ms, root, sqlite_server, name):
    _job(ms, root, steps=(100,))
    sqlite_server.settle()
    reporter = sqlite_server.client("p-token")
    r = reporter.post(f"/v1/runs/{name}/health", json={"step": 1, "loss": 1.0})
    assert r.status_code == 400 and r.json()["detail"]["code"] == "invalid_run_name"
    for _ in range(2):  # the second one would be the resume fast path's, once an answer is cached
        r = reporter.get(f"/v1/runs/{name}/resume")
        assert r.status_code == 400 and r.json()["detail"]["code"] == "invalid_run_name"
    assert [n for (n,) in query(sqlite_server.app.state.settings.db, "SELECT name FROM runs")] == ["run1"]


# --- finding 10: report tokens create nothing ckptd has not seen; operators clear bad health -----


def test_health_reports_never_create_a_run_that_is_not_on_disk(root, server, tmp_path):
    reporter = server.client("p-token")
    for n in range(60):
        r = reporter.post(f"/v1/runs/spam{n}/health", json={"step": 0, "loss": "NaN"})
        assert r.status_code == 404 and r.json()["detail"]["code"] == "not_found", r.text
    assert "has not seen" in r.json()["detail"]["message"]
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "linked")  # a symlinked run directory is never a run
    assert reporter.post("/v1/runs/linked/health", json={"step": 0}).status_code == 404
    (root / "plainfile").write_text("x")
    assert reporter.post("/v1/runs/plainfile/health", json={"step": 0}).status_code == 404
    assert query(server.app.state.settings.db, "SELECT name FROM runs") == []
    # a run's directory made by its launcher before the first save: reports are taken from step 1
    (root / "newjob").mkdir()
    assert reporter.post("/v1/runs/newjob/health", json={"step": 1, "loss": 2.0}).status_code == 204
    assert query(server.app.state.settings.db, "SELECT name, path FROM runs") == [("newjob", str(root / "newjob"))]


def test_an_operator_clears_a_wrong_nan_and_the_resume_answer_follows(ms, root, server):
    _job(ms, root)
    server.settle()
    reader, reporter, admin = server.client("r-token"), server.client("p-token"), server.client("a-token")
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 300
    assert reporter.post("/v1/runs/run1/health", json={"step": 0, "loss": "NaN"}).status_code == 204
    r = reader.get("/v1/runs/run1/resume")
    assert r.status_code == 404 and r.json()["detail"]["code"] == "no_restorable_step"  # every step ruled out
    assert reporter.delete("/v1/runs/run1/health").status_code == 403  # clearing needs admin
    assert admin.delete("/v1/runs/nope/health").status_code == 404
    r = admin.delete("/v1/runs/run1/health", params={"from_step": 0})
    assert r.status_code == 200 and r.json() == {"run": "run1", "from_step": 0, "removed": 1, "nonfinite_removed": 1}
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 300
    # from_step keeps what came before it
    for step, loss in ((50, 1.0), (150, 1.1), (250, "Infinity")):
        reporter.post("/v1/runs/run1/health", json={"step": step, "loss": loss})
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 200
    r = admin.delete("/v1/runs/run1/health", params={"from_step": 200})
    assert r.json()["removed"] == 1 and r.json()["nonfinite_removed"] == 1
    assert reader.get("/v1/runs/run1/resume").json()["step"] == 300
    assert [s for (s,) in query(server.app.state.settings.db, "SELECT step FROM step_health ORDER BY step")] == [50, 150]


# --- finding 11: tokens that count, and `ckptd serve` errors in one line --------------------------


@pytest.mark.parametrize("tokens", [{"": "admin"}, {" ": "admin"}, {"tok en": "read"}, {"tøken": "admin"},
                                    {"ok-token": "admin", "": "read"}])
def test_an_unusable_token_is_a_configuration_error(tokens):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="usable bearer token"):
        Settings(tokens=tokens)


def test_a_token_file_with_an_unusable_token_is_refused(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("admin good-token\nread tøken\n")
    with pytest.raises(ConfigError, match="line 2: a token has a space, a control or a non-ASCII character"):
        Settings(token_file=f).all_tokens()


def test_serve_refuses_an_empty_token_set_beyond_loopback(root):
    r = _ckptd("serve", "--host", "0.0.0.0", "--root", str(root), "--port", str(free_port()),
               env={"CKPTD_TOKENS": '{"": "admin"}'}, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "invalid configuration: tokens: a token is empty" in r.stderr and "Traceback" not in r.stderr
    r = _ckptd("serve", "--host", "0.0.0.0", "--root", str(root), env={"CKPTD_TOKENS": '{"s3cret": "superuser"}'})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "s3cret" not in r.stderr


def test_serve_with_a_missing_root_or_catalog_says_so_in_one_line(tmp_path, root):
    r = _ckptd("serve", "--root", str(tmp_path / "missing"), "--db", f"sqlite:///{tmp_path / 'c.db'}",
               "--port", str(free_port()), timeout=30)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"ckptd: error: {tmp_path / 'missing'}: checkpoint root is not a directory" in r.stderr
    assert "Traceback" not in r.stderr and "Application startup failed" not in r.stderr
    r = _ckptd("serve", "--root", str(root), "--db", f"sqlite:///{tmp_path / 'empty.db'}", "--port", str(free_port()),
               timeout=30)
    assert r.returncode == 1 and "the catalog has no ckptd schema yet" in r.stderr and "Traceback" not in r.stderr
    r = _ckptd("serve", "--root", str(root), "--verify-workers", "0", timeout=30)
    assert r.returncode == 2 and "verify_workers" in r.stderr and "Traceback" not in r.stderr


def test_serve_token_file_flag_is_honoured(tmp_path, root):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    assert _ckptd("db", "upgrade", "--db", db).returncode == 0
    tokens = tmp_path / "tokens"
    tokens.write_text("read flag-read-token\nadmin flag-admin-token\n")
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--db", db, "--port", str(port),
                             "--token-file", str(tokens)], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "ckptd serve did not come up"
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/runs").status_code == 401
        assert httpx.get(f"{url}/v1/runs", headers={"Authorization": "Bearer flag-read-token"}).status_code == 200
        denied = httpx.post(f"{url}/v1/runs/x/gc", json={}, headers={"Authorization": "Bearer flag-read-token"})
        assert denied.status_code == 403
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
