"""The container's command is exactly what runs here: parse docker/Dockerfile's CMD and run it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.api_helpers import free_port

REPO = Path(__file__).resolve().parents[1]


def _dockerfile_cmd() -> tuple[list[str], dict[str, str]]:
    text = (REPO / "docker" / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    env = {}
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        env.update(dict(kv.split("=", 1) for kv in line.split()))
    return cmd, env


def test_container_command_serves_with_auth_on_all_interfaces(tmp_path, catalog_url):
    cmd, image_env = _dockerfile_cmd()
    assert cmd[:2] == ["sh", "-c"] and "ckptd serve" in cmd[2] and "ckptd db upgrade" in cmd[2]
    port = free_port()
    root = tmp_path / "checkpoints"
    root.mkdir()
    env = dict(os.environ, **image_env)
    env.update(CKPTD_ROOT=str(root), CKPTD_PORT=str(port), CKPTD_DB=catalog_url,
               CKPTD_TOKEN_FILE=str(REPO / "docker" / "tokens.example"))
    env["PATH"] = f"{Path(os.sys.executable).parent}:{env['PATH']}"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/runs").status_code == 401
        ok = httpx.get(f"http://127.0.0.1:{port}/v1/runs", headers={"Authorization": "Bearer change-me-launcher-token"})
        assert ok.status_code == 200 and ok.json() == []
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_container_command_without_tokens_refuses_to_listen_publicly(tmp_path, catalog_url):
    cmd, image_env = _dockerfile_cmd()
    env = dict(os.environ, **image_env)
    env.update(CKPTD_ROOT=str(tmp_path), CKPTD_PORT=str(free_port()), CKPTD_DB=catalog_url)
    env["PATH"] = f"{Path(os.sys.executable).parent}:{env['PATH']}"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "refusing to listen on 0.0.0.0 without authentication" in out.stderr
