"""Asking "where do we resume from?": ckptd's resume oracle over HTTP, or any command printing its JSON.

The answer is ckptd's ``GET /v1/runs/{run}/resume`` body: ``{"run", "step", "epoch", "global_step",
"strategy_file", "shards": [{"rank", "path"}], "skipped": [{"step", "reason"}]}``; "nothing to
resume" is HTTP 404 ``{"detail": {"code": "no_restorable_step"}}`` -- or ``"not_found"`` for a run ckptd
has not catalogued yet (a brand-new job) -- (or a command exiting non-zero /
printing that body).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
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
        skipped = detail.get("skipped") or []
        why = f"{source}: no restorable step"
        if skipped:
            why += "; skipped " + _skipped_text(skipped)
        return ResumeAnswer(None, None, why)
    if isinstance(detail, dict) and detail.get("code") == "not_found":
        # ckptd has never seen this run (no shard, no health report yet): nothing to resume from
        return ResumeAnswer(None, None, f"{source}: run not in the catalog yet")
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
        why += "; skipped " + _skipped_text(skipped)
    return ResumeAnswer(step, body, why)


def _skipped_text(skipped: list) -> str:
    return ", ".join(f"{s.get('step')} ({s.get('reason')})" for s in skipped[:3] if isinstance(s, dict))


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


# --- waiting for ckptd to catch up with the disk ---------------------------------------------------

_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)\.ckpt$")
#: a step state that will not change by itself any more (see ckptd/states.py)
FINAL_STATES = frozenset({"verified", "corrupt", "deleted", "deleting"})


def committed_steps(run_dir: str, world: int) -> list[tuple[int, int]]:
    """(epoch, step) of every save committed on disk by all ranks, newest first.

    A shard is committed once it has its ``.done`` sidecar or MindSpore's final ``chmod 0400`` (done
    right after its tmp -> final rename; a rank killed between that and its sidecar leaves exactly
    this). Only the files' presence and mode: whether they are intact is ckptd's verdict, not ours.
    """
    seen: dict[tuple[int, int], int] = {}
    for rank in range(world):
        d = os.path.join(run_dir, f"rank_{rank}")
        try:
            names = set(os.listdir(d))
        except OSError:
            return []
        for name in names:
            m = _SHARD.match(name)
            if m and (name + ".done" in names or _read_only(os.path.join(d, name))):
                key = (int(m.group("epoch")), int(m.group("step")))
                seen[key] = seen.get(key, 0) + 1
    return sorted((k for k, n in seen.items() if n == world), reverse=True)


def _read_only(path: str) -> bool:
    try:
        return not os.stat(path).st_mode & 0o222
    except OSError:
        return False


def _get_json(url: str, timeout: float) -> object:
    req = urllib.request.Request(url, method="GET")
    token = os.environ.get("CKPTD_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@dataclass(frozen=True)
class Settled:
    settled: bool
    waited: float
    #: (epoch, step) -> ckptd's state for the committed saves that were looked at, newest first
    states: dict[tuple[int, int], str]


def wait_for_verdicts(url: str, run: str, run_dir: str, world: int, timeout: float, poll: float = 0.25) -> Settled:
    """Wait until ckptd has a final verdict on the newest save that is committed on disk.

    The job was just stopped: its last save may have been renamed and sidecar'd a moment ago and ckptd
    (settling, verifying) not have caught up. Asking the oracle right away would be answered -- safely
    -- with an older step and lose work. So walk the committed saves newest first: a verified one ends
    the walk (the oracle will see it), a corrupt/deleted one moves on to the next, anything else
    (unknown to ckptd, incomplete, pending) means wait. Never longer than ``timeout``; ckptd stays the
    judge of what is restorable either way.
    """
    t0 = time.monotonic()
    base = f"{url.rstrip('/')}/v1/runs/{run}/steps"
    states: dict[tuple[int, int], str] = {}
    while True:
        candidates = committed_steps(run_dir, world)
        try:
            rows = _get_json(f"{base}?limit=1000", timeout=5.0)
            known = {(int(r["epoch"]), int(r["step"])): str(r["state"]) for r in rows if r.get("kind", "trained") == "trained"}
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
            known = {}  # run not catalogued yet (404), or ckptd briefly unreachable: keep waiting
        states, settled = {}, True
        for key in candidates:
            states[key] = known.get(key, "unknown")
            if states[key] == "verified":
                break
            if states[key] not in FINAL_STATES:
                settled = False
                break
        waited = time.monotonic() - t0
        if settled or waited >= timeout:
            return Settled(settled, waited, states)
        time.sleep(poll)
