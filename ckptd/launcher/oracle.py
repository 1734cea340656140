"""Asking "where do we resume from?": ckptd's resume oracle over HTTP, or any command printing its JSON.

Shared by ckptd's generic launcher (:mod:`ckptd.launcher`) and the trainer's (``trainer.launch``,
which adds its own scan of the run directory as a fallback oracle: ``trainer.oracle``). No MindSpore.

The answer is ckptd's ``GET /v1/runs/{run}/resume`` body: ``{"run", "step", "epoch", "global_step",
"strategy_file", "shards": [{"rank", "path"}], "skipped": [{"step", "reason"}]}``; "nothing to
resume" is HTTP 404 ``{"detail": {"code": "no_restorable_step"}}`` -- or ``"not_found"`` for a run ckptd
has not catalogued yet (a brand-new job) -- (or a command exiting non-zero /
printing that body).

Three kinds of outcome, kept apart because the launcher acts differently on each:

* an answer -- a step, or a definite "nothing to resume" (404 ``no_restorable_step`` / ``not_found``):
  acted on at once;
* :class:`OracleUnavailable` -- ckptd could not be asked right now (connection refused or reset, a
  timeout, HTTP 5xx / 429 / 408): worth asking again (the launcher retries up to ``--oracle-wait``);
* any other :class:`OracleError` -- a malformed answer, a refused token (401/403), another 4xx: asking
  again would get the same, so the launcher stops.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from ckptd import runlayout, stepname


@dataclass(frozen=True)
class ResumeAnswer:
    step: int | None  # None: nothing restorable -> fresh start
    body: dict | None
    why: str
    #: the world size the answered checkpoint was saved with, when it differs from the job's (elastic
    #: restart: the shards are not the job's and must not be used as they are); None otherwise
    saved_world: int | None = None
    #: ckptd's ``conversion`` block when the question named a world size (``?world_size=W``)
    conversion: dict | None = None
    #: False when the oracle does not know the run at all (``not_found``): "nothing to resume" is
    #: then no verdict on the saves on disk (:mod:`ckptd.launcher.freshstart`)
    catalogued: bool = True


class OracleError(RuntimeError):
    """The oracle could not be asked or answered nonsense (the launcher stops rather than guess)."""


class OracleUnavailable(OracleError):
    """ckptd could not be asked right now: unreachable, timed out, or HTTP 5xx/429/408 (ask again later)."""


#: HTTP statuses that say "not now" rather than "no": the server (or a proxy in front of it) is
#: restarting, overloaded or timed out
TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})


def is_transient(err: BaseException) -> bool:
    """Whether a failed HTTP request is worth repeating: no connection, a connection lost mid-answer,
    a timeout, or a transient status. A definite HTTP answer (4xx) is not."""
    if isinstance(err, urllib.error.HTTPError):
        return err.code in TRANSIENT_HTTP or err.code >= 500
    if isinstance(err, urllib.error.URLError):
        return True  # refused, reset, DNS, timeout while connecting
    # a timeout while reading, a connection reset or closed mid-answer, a truncated body
    return isinstance(err, (TimeoutError, socket.timeout, ConnectionError, http.client.HTTPException, OSError))


def interpret_answer(body: object, world: int, source: str) -> ResumeAnswer:
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
        return ResumeAnswer(None, None, f"{source}: run not in the catalog yet", catalogued=False)
    try:
        step = int(body["step"])
        ranks = sorted(int(s["rank"]) for s in body["shards"])
        saved = body.get("world_size")
        saved = int(saved) if saved is not None else None
    except (KeyError, TypeError, ValueError) as err:
        raise OracleError(f"{source}: malformed answer ({err!r})") from None
    conversion = body.get("conversion") if isinstance(body.get("conversion"), dict) else None
    if saved is not None and saved != world:
        # saved under another layout: the caller decides (convert / use a converted copy), never these shards
        if ranks != list(range(saved)):
            raise OracleError(f"{source}: answer for step {step} covers ranks {ranks}, it says world size {saved}")
        return ResumeAnswer(step, body, f"{source}: newest restorable step {step} was saved with world size "
                                         f"{saved}, the job has {world}", saved, conversion)
    if ranks != list(range(world)):
        raise OracleError(f"{source}: answer for step {step} covers ranks {ranks}, the job has {world}")
    skipped = body.get("skipped") or []
    why = f"{source}: newest restorable step {step}"
    if skipped:
        why += "; skipped " + _skipped_text(skipped)
    return ResumeAnswer(step, body, why, None, conversion)


def _skipped_text(skipped: list) -> str:
    return ", ".join(f"{s.get('step')} ({s.get('reason')})" for s in skipped[:3] if isinstance(s, dict))


def ask_http(url: str, run: str, world: int, timeout: float = 10.0, world_size: int | None = None,
             exclude_unreachable: bool = False) -> ResumeAnswer:
    """``world_size``: name the job's world size in the question (ckptd then says whether a conversion
    is needed and where a ready converted copy is). ``exclude_unreachable``: ask for the newest step
    none of whose shards is on a node whose daemon is silent (after a node loss).

    Raises :class:`OracleUnavailable` when ckptd could not be asked (see :func:`is_transient`), and
    :class:`OracleError` for an answer that is not one (a malformed body, 401/403, another 4xx)."""
    params = {"world_size": str(int(world_size))} if world_size is not None else {}
    if exclude_unreachable:
        params["exclude_unreachable"] = "true"
    query = "?" + urllib.parse.urlencode(params) if params else ""
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/runs/{run}/resume{query}", method="GET")
    token = os.environ.get("CKPTD_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        if err.code == 404:
            try:
                return interpret_answer(json.loads(err.read()), world, "ckptd")
            except (ValueError, OracleError, OSError, http.client.HTTPException):
                pass
            # a 404 that is not ckptd's (wrong URL, another service): asking again will not help
            raise OracleError(f"ckptd answered HTTP 404 without a resume answer (is {url} ckptd?)") from None
        if is_transient(err):
            raise OracleUnavailable(f"ckptd answered HTTP {err.code}") from None
        raise OracleError(f"ckptd answered HTTP {err.code}") from None
    except Exception as err:  # noqa: BLE001 -- classified: transient (ask again) or not
        if is_transient(err):
            raise OracleUnavailable(f"ckptd unreachable: {_reason(err)}") from None
        raise OracleError(f"asking ckptd failed: {type(err).__name__}: {err}") from None
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise OracleError(f"ckptd: malformed answer (not JSON: {err})") from None
    return interpret_answer(body, world, "ckptd")


def _reason(err: BaseException) -> str:
    inner = getattr(err, "reason", None)
    text = str(inner if inner is not None else err) or type(err).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def check_ready(url: str, timeout: float = 5.0) -> None:
    """Raise :class:`OracleUnavailable` while ckptd is up but has not finished its first rescan of
    the root (``/healthz`` says ``first_rescan_done: false``): until then its catalog does not know
    what changed on disk while it was down (a save, a rotten file), and an answer could be stale.
    Unreachable: OracleUnavailable as well. Anything else -- a stalled worker (503 with the field
    true), a ckptd without the field, an unreadable body -- lets the resume question decide."""
    req = urllib.request.Request(f"{url.rstrip('/')}/healthz", method="GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        try:
            raw = err.read()
        except (OSError, http.client.HTTPException):
            raw = b""
    except Exception as err:  # noqa: BLE001 -- classified
        if is_transient(err):
            raise OracleUnavailable(f"ckptd unreachable: {_reason(err)}") from None
        return
    try:
        doc = json.loads(raw)
    except ValueError:
        return
    if isinstance(doc, dict) and doc.get("first_rescan_done") is False:
        raise OracleUnavailable("ckptd is starting: its first rescan of the checkpoint root is not done")


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
            answer = interpret_answer(body, world, "resume-cmd")
            if answer.step is None:
                return answer
        raise OracleError(f"resume command exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return interpret_answer(body, world, "resume-cmd")


# --- waiting for ckptd to catch up with the disk ---------------------------------------------------

#: a step state that will not change by itself any more (see ckptd/states.py)
FINAL_STATES = frozenset({"verified", "corrupt", "deleted", "deleting"})


def committed_saves(run_dir: str, world: int) -> list[tuple[str, int, int]]:
    """(prefix, epoch, step) of every save committed on disk by all ranks, newest first -- the step's
    identity as ckptd catalogues it (:mod:`ckptd.runlayout`: the prefix without the MindFormers rank
    tag, with its restart suffix ``_k``; epoch and step from the file name). Either layout, detected
    per run; ``_breakpoint`` files are never trained saves.

    A shard is committed once it has its ``.done`` sidecar or MindSpore's final ``chmod 0400`` (done
    right after its tmp -> final rename; a rank killed between that and its sidecar leaves exactly
    this). Only the files' presence and mode: whether they are intact is ckptd's verdict, not ours.
    """
    return [key for key, _ in _committed(run_dir, world)]


def committed_save_files(run_dir: str, world: int) -> list[str]:
    """Rank 0's file of every committed save (see committed_saves), newest first, relative to the run dir."""
    return [os.path.relpath(path, run_dir) for _, path in _committed(run_dir, world)]


def _committed(run_dir: str, world: int) -> list[tuple[tuple[str, int, int], str]]:
    dirs = runlayout.rank_dirs(run_dir)
    seen: dict[tuple[str, int, int], int] = {}
    restart: dict[tuple[str, int, int], int] = {}
    first: dict[tuple[str, int, int], str] = {}
    for rank in range(world):
        d = dirs.get(rank)
        try:
            names = set(os.listdir(d)) if d is not None else None
        except OSError:
            names = None
        if names is None:
            return []
        for name in names:
            parsed = runlayout.parse_shard_name(name, rank)
            if parsed is None or parsed[3] or parsed[4] != "ckpt":
                continue
            if name + runlayout.SIDECAR_SUFFIX in names or _read_only(os.path.join(d, name)):
                key = (parsed[0], parsed[1], parsed[2])
                seen[key] = seen.get(key, 0) + 1
                restart[key] = parsed[5] or 0
                if rank == 0:
                    first[key] = os.path.join(d, name)
    done = [k for k, n in seen.items() if n == world]
    # of two restarts' saves of one (epoch, step), the later restart's first
    return [(k, first[k]) for k in sorted(done, key=lambda k: (k[1], k[2], restart[k]), reverse=True)]


def committed_steps(run_dir: str, world: int) -> list[tuple[int, int]]:
    """(epoch, step) of every save committed on disk by all ranks, newest first (see committed_saves;
    one entry per (epoch, step) even when several restarts saved it)."""
    out: list[tuple[int, int]] = []
    for _, epoch, step in committed_saves(run_dir, world):
        if (epoch, step) not in out:
            out.append((epoch, step))
    return out


def _int_or_none(value: object) -> int | None:
    try:
        return int(value) if value is not None else None  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


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


def get_json(url: str, path: str, timeout: float) -> object:
    """``GET url+path`` (read scope: ``CKPTD_TOKEN``) as JSON: :class:`OracleUnavailable` when ckptd
    cannot be asked now, :class:`OracleError` for any other failure (a refused token, a 4xx, not JSON)."""
    target = f"{url.rstrip('/')}{path}"
    try:
        return _get_json(target, timeout)
    except urllib.error.HTTPError as err:
        if is_transient(err):
            raise OracleUnavailable(f"ckptd answered HTTP {err.code} to GET {target}") from None
        raise OracleError(f"ckptd answered HTTP {err.code} to GET {target}") from None
    except ValueError as err:
        raise OracleError(f"ckptd: malformed answer to GET {target} (not JSON: {err})") from None
    except Exception as err:  # noqa: BLE001 -- classified: transient (ask again) or not
        if is_transient(err):
            raise OracleUnavailable(f"ckptd unreachable: {_reason(err)}") from None
        raise OracleError(f"GET {target} failed: {type(err).__name__}: {err}") from None


@dataclass(frozen=True)
class Settled:
    settled: bool
    waited: float
    #: (epoch, step) -> ckptd's state for the committed saves that were looked at, newest first
    states: dict[tuple[int, int], str]
    #: (epoch, step) -> the save as users count it, for log lines (:func:`ckptd.stepname.label`)
    labels: dict[tuple[int, int], str] = field(default_factory=dict)


def wait_for_verdicts(url: str, run: str, run_dir: str, world: int, timeout: float, poll: float = 0.25,
                      raise_unavailable: bool = False) -> Settled:
    """Wait until ckptd has a final verdict on the newest save that is committed on disk.

    The job was just stopped: its last save may have been renamed and sidecar'd a moment ago and ckptd
    (settling, verifying) not have caught up. Asking the oracle right away would be answered -- safely
    -- with an older step and lose work. So walk the committed saves newest first: a verified one ends
    the walk (the oracle will see it), a corrupt/deleted one moves on to the next, anything else
    (unknown to ckptd, incomplete, pending) means wait. Never longer than ``timeout``; ckptd stays the
    judge of what is restorable either way.

    ``raise_unavailable``: a ckptd that cannot be asked (see :func:`is_transient`) raises
    :class:`OracleUnavailable` instead of being waited for here (the launcher then waits with
    back-off and logs it), and a refused token raises :class:`OracleError`; a run ckptd does not
    know yet (404) is still waited for.
    """
    t0 = time.monotonic()
    base = f"{url.rstrip('/')}/v1/runs/{run}/steps"
    states: dict[tuple[int, int], str] = {}
    while True:
        candidates = committed_saves(run_dir, world)
        try:
            rows = _get_json(f"{base}?limit=1000", timeout=5.0)
            trained = [r for r in rows if r.get("kind", "trained") == "trained"]
            known = {(r.get("prefix"), int(r["epoch"]), int(r["step"])): str(r["state"]) for r in trained}
            seen_as = {(int(r["epoch"]), int(r["step"])): r.get("training_step") for r in trained}
        except urllib.error.HTTPError as err:
            if raise_unavailable and err.code in (401, 403):
                raise OracleError(f"ckptd answered HTTP {err.code} to GET {base}") from None
            if raise_unavailable and is_transient(err):
                raise OracleUnavailable(f"ckptd answered HTTP {err.code}") from None
            known, seen_as = {}, {}  # run not catalogued yet (404): keep waiting
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            if raise_unavailable:
                raise OracleUnavailable(f"ckptd unreachable: {_reason(err)}") from None
            known, seen_as = {}, {}  # ckptd briefly unreachable: keep waiting
        except (ValueError, KeyError, TypeError, AttributeError):
            known, seen_as = {}, {}  # an answer this version does not understand: the oracle still decides
        by_name: dict[tuple[int, int], list[str]] = {}
        for (_, epoch, step), state in known.items():
            by_name.setdefault((epoch, step), []).append(state)
        states, settled = {}, True
        for prefix, epoch, step in candidates:
            state = known.get((prefix, epoch, step))
            if state is None:  # a row without (or with another spelling of) the prefix: only if unambiguous
                same = by_name.get((epoch, step), [])
                state = same[0] if len(same) == 1 else "unknown"
            states.setdefault((epoch, step), state)
            if state == "verified":
                break
            if state not in FINAL_STATES:
                states[(epoch, step)] = state
                settled = False
                break
        waited = time.monotonic() - t0
        if settled or waited >= timeout:
            labels = {k: stepname.label(None, _int_or_none(seen_as.get(k)), *k) for k in states}
            return Settled(settled, waited, states, labels)
        time.sleep(poll)


# --- elastic restart: asking ckptd to re-shard a step for the job's layout ------------------------


class ConversionError(OracleError):
    """ckptd could not give the job a checkpoint in its layout (the launcher gives up, never starts fresh)."""


class ConversionUnavailable(ConversionError, OracleUnavailable):
    """ckptd could not be asked about a conversion right now: the launcher asks again within
    ``--oracle-wait``, and then gives up (never a local scan or a fresh start)."""


def _admin_token() -> str | None:
    return os.environ.get("CKPTD_ADMIN_TOKEN") or os.environ.get("CKPTD_TOKEN")


def _call(url: str, method: str, body: dict | None, timeout: float) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    token = _admin_token()
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            detail = json.loads(err.read()).get("detail")
        except (ValueError, AttributeError):
            detail = None
        msg = detail.get("message") if isinstance(detail, dict) else detail
        kind = ConversionUnavailable if is_transient(err) else ConversionError
        raise kind(f"ckptd answered HTTP {err.code} to {method} {url}: {msg or err.reason}") from None
    except ValueError as err:
        raise ConversionError(f"ckptd's answer to {method} {url} is not JSON: {err}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        raise ConversionUnavailable(f"ckptd unreachable ({method} {url}): {_reason(err)}") from None


def request_conversion(url: str, run: str, step: int, to_layout: str, timeout: float = 30.0) -> int:
    """``POST /v1/runs/{run}/conversions`` (admin scope) to ``to_layout`` (``tp=..,dp=..[,pp=..]``,
    :class:`ckptd.launcher.elastic.Layout`'s text): returns the background job's id."""
    doc = _call(f"{url.rstrip('/')}/v1/runs/{run}/conversions", "POST", {"step": int(step), "to_layout": to_layout},
                timeout)
    try:
        return int(doc["id"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        raise ConversionError(f"ckptd's conversion answer has no job id: {str(doc)[:200]}") from None


def wait_for_job(url: str, job_id: int, timeout: float, poll: float = 0.5) -> dict:
    """Poll ``GET /v1/jobs/{id}`` until done (returns the job) -- failed or still running after
    ``timeout`` seconds raises ConversionError."""
    t0 = time.monotonic()
    while True:
        job = _call(f"{url.rstrip('/')}/v1/jobs/{int(job_id)}", "GET", None, 10.0)
        state = job.get("state") if isinstance(job, dict) else None
        if state == "done":
            return job  # type: ignore[return-value]
        if state == "failed":
            why = job.get("error") or job.get("result") or "no reason given"  # type: ignore[union-attr]
            raise ConversionError(f"conversion job {job_id} failed: {str(why)[:300]}")
        if time.monotonic() - t0 >= timeout:
            raise ConversionError(f"conversion job {job_id} still {state} after {timeout:.0f}s")
        time.sleep(poll)


def list_conversions(url: str, run: str, timeout: float = 10.0) -> list[dict]:
    """``GET /v1/runs/{run}/conversions``: the run's conversion jobs, newest first ([] for an unknown run)."""
    try:
        rows = _call(f"{url.rstrip('/')}/v1/runs/{run}/conversions", "GET", None, timeout)
    except ConversionError as err:
        if "HTTP 404" in str(err):
            return []
        raise
    if not isinstance(rows, list):
        raise ConversionError(f"ckptd's conversion list is not a list: {str(rows)[:200]}")
    return [r for r in rows if isinstance(r, dict)]
