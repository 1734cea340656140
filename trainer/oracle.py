"""Asking "where do we resume from?": ckptd's resume oracle over HTTP, or any command printing its JSON.

The answer is ckptd's ``GET /v1/runs/{run}/resume`` body: ``{"run", "step", "epoch", "global_step",
"strategy_file", "shards": [{"rank", "path"}], "skipped": [{"step", "reason"}]}``; "nothing to
resume" is HTTP 404 ``{"detail": {"code": "no_restorable_step"}}`` (or a command exiting non-zero /
printing that body).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class ResumeAnswer:
    step: int | None  # None: nothing restorable -> fresh start
    body: dict | None
    why: str


class OracleError(RuntimeError):
    """The oracle could not be asked or answered nonsense (the launcher stops rather than guess)."""


def _interpret(body: object, world: int, source: str) -> ResumeAnswer:
    if not isinstance(body, dict):
        raise OracleError(f"{source}: answer is not a JSON object")
    detail = body.get("detail")
    if isinstance(detail, dict) and detail.get("code") == "no_restorable_step":
        return ResumeAnswer(None, None, f"{source}: no restorable step")
    try:
        step = int(body["step"])
        ranks = sorted(int(s["rank"]) for s in body["shards"])
    except (KeyError, TypeError, ValueError) as err:
        raise OracleError(f"{source}: malformed answer ({err!r})") from None
    if ranks != list(range(world)):
        raise OracleError(f"{source}: answer for step {step} covers ranks {ranks}, the job has {world}")
    skipped = body.get("skipped") or []
    why = f"{source}: newest restorable step {step}"
    if skipped:
        why += "; skipped " + ", ".join(f"{s.get('step')} ({s.get('reason')})" for s in skipped[:3])
    return ResumeAnswer(step, body, why)


def ask_http(url: str, run: str, world: int, timeout: float = 10.0) -> ResumeAnswer:
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/runs/{run}/resume", method="GET")
    token = os.environ.get("CKPTD_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return _interpret(json.loads(resp.read()), world, "ckptd")
    except urllib.error.HTTPError as err:
        if err.code == 404:
            try:
                return _interpret(json.loads(err.read()), world, "ckptd")
            except (ValueError, OracleError):
                pass
        raise OracleError(f"ckptd answered HTTP {err.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise OracleError(f"ckptd unreachable: {err}") from None


def ask_command(cmd: str, world: int, timeout: float = 60.0) -> ResumeAnswer:
    try:
        proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise OracleError(f"resume command timed out after {timeout}s") from None
    try:
        body = json.loads(proc.stdout) if proc.stdout.strip() else None
    except ValueError:
        body = None
    if proc.returncode != 0:
        if isinstance(body, dict):
            answer = _interpret(body, world, "resume-cmd")
            if answer.step is None:
                return answer
        raise OracleError(f"resume command exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return _interpret(body, world, "resume-cmd")
