"""A real ckptd server (uvicorn on a free loopback port, in a thread) for API tests."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

from ckptd.api.app import create_app
from ckptd.launcher.supervise import free_port  # noqa: F401  (the tests' one way to pick a port)
from ckptd.settings import Settings


def serve_process(root, catalog_url: str, log, *args: str, **env: str):
    """``ckptd serve`` as its own process (file events, not rescans, find new saves: a 30 s rescan
    interval) on a free port: ``(process, client)``; its output goes to ``log``."""
    import os
    import subprocess
    import sys

    port = free_port()
    environ = dict(os.environ, CKPTD_SETTLE_SECONDS="0.2", CKPTD_RESCAN_INTERVAL="30", **env)
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--db", catalog_url,
                             "--port", str(port), *args], env=environ, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    return proc, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)


def resume_of(proc, client: httpx.Client, log, run: str) -> dict | None:
    """The resume answer of a :func:`serve_process` server (None: not 200 or not up yet); a dead
    server fails the test with its log."""
    if proc.poll() is not None:
        raise AssertionError(f"ckptd serve exited {proc.returncode}:\n{open(log).read()[-3000:]}")
    try:
        r = client.get(f"/v1/runs/{run}/resume", params={"lease": "false"})
    except httpx.TransportError:
        return None
    return r.json() if r.status_code == 200 else None


def stop_process(proc, grace: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds (a server's shutdown is bounded; a test's is too)."""
    import signal
    import subprocess

    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Server:
    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        self.app = create_app(settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    @property
    def daemon(self):
        return self.app.state.daemon

    def settle(self) -> None:
        """Wait until the watcher has seen everything on disk and verification is idle."""
        self.daemon.watcher.poke_rescan()
        assert self.daemon.wait_idle(60), "daemon did not settle"
