"""The job side of supervision: liveness (heartbeat files for the launcher), best-effort health
reports to ckptd, and the ``.done`` commit hint of a finished shard -- what ckptd's trainer and the
MindSpore callback (``ckptd.integrations.mindspore_callback``) both write.

Neither may ever slow training down: the heartbeat is one small write + rename per step (no fsync:
it is a liveness signal, stale-after-crash is exactly what the launcher wants to see), and health
reports go through a bounded queue to a daemon thread that drops reports when ckptd is slow or down.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request

import xxhash

from ckptd import runlayout
from ckptd.atomic import atomic_write


def heartbeat_path(hb_dir: str, rank: int) -> str:
    return os.path.join(hb_dir, f"rank_{rank}.json")


def exit_path(hb_dir: str, rank: int) -> str:
    return os.path.join(hb_dir, f"rank_{rank}.exit")


def write_json_fast(path: str, doc: dict) -> None:
    """Replace ``path`` atomically (write + rename) without fsync -- for liveness files only."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


def write_sidecar(path: str) -> None:
    """Commit hint for the daemon, once the shard is complete: its size and xxh3_128 digest (ckptd's
    verifier compares the file against it)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    doc = {"size": os.path.getsize(path), "xxh3_128": h.hexdigest()}
    with atomic_write(runlayout.sidecar_for(path), overwrite=True) as out:
        out.write(json.dumps(doc).encode())


class Heartbeat:
    def __init__(self, hb_dir: str, rank: int, attempt: int) -> None:
        os.makedirs(hb_dir, exist_ok=True)
        self.hb_dir, self.rank, self.attempt = hb_dir, rank, attempt

    def beat(self, step: int, phase: str, startup: bool = False) -> None:
        """``startup``: this step still sets the job up (compiles, opens collectives), so the
        launcher judges it by its start-up allowance, as the ``starting`` phase."""
        doc = {"pid": os.getpid(), "rank": self.rank, "step": step, "phase": phase, "time": time.time(),
               "attempt": self.attempt}
        if startup:
            doc["startup"] = True
        write_json_fast(heartbeat_path(self.hb_dir, self.rank), doc)

    def exited(self, code: int, step: int) -> None:
        write_json_fast(exit_path(self.hb_dir, self.rank), {"code": code, "step": step, "attempt": self.attempt})


#: pauses before the second and third try of a health report that met a timeout, a connection
#: error or a 5xx
RETRY_PAUSES = (0.2, 1.0)


class HealthReporter:
    """``POST {url}/v1/runs/{run}/health`` from a background thread; never blocks, never raises."""

    def __init__(self, url: str | None, run: str, token: str | None, timeout: float = 3.0) -> None:
        self.url = f"{url.rstrip('/')}/v1/runs/{run}/health" if url else None
        self.token, self.timeout = token, timeout
        self.q: queue.Queue[dict] = queue.Queue(maxsize=64)
        self.sent = self.failed = self.dropped = 0
        if self.url:
            threading.Thread(target=self._run, name="ckptd-health", daemon=True).start()

    def report(self, step: int, loss: float, grad_norm: float | None, overflow: bool) -> None:
        if not self.url:
            return
        doc = {"step": int(step), "loss": float(loss), "grad_norm": None if grad_norm is None else float(grad_norm),
               "overflow": bool(overflow)}
        try:
            self.q.put_nowait(doc)
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout: float | None = None) -> bool:
        """At the end of training: give queued reports up to ``timeout`` s (default: one report's
        tries and pauses) to go out (the last steps' health would otherwise die with the process).
        Bounded, so a down ckptd costs at most that."""
        if timeout is None:
            timeout = (len(RETRY_PAUSES) + 1) * self.timeout + sum(RETRY_PAUSES)
        deadline = time.monotonic() + timeout
        while self.url and self.q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not (self.url and self.q.unfinished_tasks)

    def _run(self) -> None:
        while True:
            doc = self.q.get()
            try:
                self._post(doc)
            finally:
                self.q.task_done()

    def _post(self, doc: dict) -> None:
        req = urllib.request.Request(self.url, data=json.dumps(doc).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        # A busy ckptd (its catalog writing a burst of shards) can miss one timeout; a report is an
        # upsert per step, so sending it again is safe. A refusal (4xx) is final.
        for pause in (*RETRY_PAUSES, None):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    resp.read()
                self.sent += 1
                return
            except urllib.error.HTTPError as exc:
                exc.close()
                if exc.code < 500:
                    break
            except Exception:  # noqa: BLE001, S110 -- ckptd down/slow: health is best effort by design
                pass
            if pause is not None:
                time.sleep(pause)
        self.failed += 1
