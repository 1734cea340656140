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

from ckptd import runlayout
from ckptd.split import ParallelSplit


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
    #: steps ckptd has not finished judging when it found nothing restorable (``detail.unjudged``):
    #: they may still become restorable, so that answer is no verdict on them
    unjudged: tuple[int, ...] = ()
    #: of those, the ones only a silent node's daemon can judge (``detail.unjudged_unreachable``):
    #: step -> those nodes
    unjudged_unreachable: dict[str, list[str]] = field(default_factory=dict)


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
        unjudged = detail.get("unjudged") or []
        steps = tuple(int(s) for s in unjudged if isinstance(s, int)) if isinstance(unjudged, list) else ()
        blocked = detail.get("unjudged_unreachable")
        blocked = {str(k): [str(n) for n in v] for k, v in blocked.items() if isinstance(v, list)} \
            if isinstance(blocked, dict) else {}
        return ResumeAnswer(None, None, why, unjudged=steps, unjudged_unreachable=blocked)
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
             exclude_unreachable: bool = False, split: ParallelSplit | None = None, strategy_hash: str | None = None,
             max_step: int | None = None, tiers: str | None = None) -> ResumeAnswer:
    """``world_size``: name the job's world size in the question (ckptd then says whether a conversion
    is needed and where a ready converted copy is); ``split`` (the job's tp/dp/pp) or ``strategy_hash``
    (of the strategy it will write): the same for exactly that layout. ``exclude_unreachable``: ask
    for the newest step none of whose shards is on a node whose daemon is silent (after a node
    loss). ``max_step``: the newest at or before that step. ``tiers``: what the job can load from
    (``file`` for a job whose own code loads files; default ckptd's: files and node memory).

    Raises :class:`OracleUnavailable` when ckptd could not be asked (see :func:`is_transient`), and
    :class:`OracleError` for an answer that is not one (a malformed body, 401/403, another 4xx)."""
    params = {"world_size": str(int(world_size))} if world_size is not None else {}
    if exclude_unreachable:
        params["exclude_unreachable"] = "true"
    if split is not None:
        params["split"] = str(split)
    if strategy_hash is not None:
        params["strategy_hash"] = strategy_hash
    if max_step is not None:
        params["max_step"] = str(int(max_step))
    if tiers is not None:
        params["tiers"] = tiers
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


# --- the saves on disk, for the fresh-start guard only ---------------------------------------------


def committed_save_files(run_dir: str, world: int) -> list[str]:
    """Every save committed on disk, newest first, as one path relative to the run dir each: rank
    0's file of a save in ``rank_<r>/`` directories (native or MindFormers, ``.ckpt`` or
    ``.safetensors``) committed by all ``world`` ranks, or a step directory (a Checkpoint 2.0
    iteration) whole by its files' names (its layout's rule, ``RunLayout.whole_step_dir``). Paths
    are read through :mod:`ckptd.runlayout`; ``_breakpoint`` saves are never trained ones.

    Only for :mod:`ckptd.launcher.freshstart` ("never a silent fresh start"), which needs to see
    saves exactly when ckptd does not know the run: whether ckptd has judged them is asked of
    ckptd (:func:`wait_settled`), never derived here. A shard is committed once it has its
    ``.done`` sidecar or MindSpore's final ``chmod 0400`` (its presence and mode only)."""
    root = os.path.dirname(os.path.abspath(run_dir))
    saves: dict[tuple[str, int, int, int], dict[int, str]] = {}  # (prefix, epoch, step, incarnation) -> rank -> path
    whole: list[tuple[tuple[int, int, int], str]] = []  # ((epoch, step, incarnation), path)
    listed = runlayout.shard_dirs(run_dir)
    for directory in listed.shard_dirs:
        try:
            names = set(os.listdir(directory))
        except OSError:
            continue
        shards = [(n, kind) for n in names if isinstance(kind := runlayout.classify(root, os.path.join(directory, n)),
                                                          runlayout.ShardName) and not kind.breakpoint]
        if listed.layout.iterations:  # a directory is one save, whole by its files' names
            if listed.layout.whole_step_dir([kind for _, kind in shards]):
                whole.append(((0, shards[0][1].step, 0), directory))
            continue
        for name, kind in shards:
            path = os.path.join(directory, name)
            if name + runlayout.SIDECAR_SUFFIX in names or _read_only(path):
                saves.setdefault((kind.prefix, kind.epoch, kind.step, kind.incarnation or 0), {})[kind.rank] = path
    whole += [((epoch, step, inc), got[0]) for (_, epoch, step, inc), got in saves.items()
              if all(r in got for r in range(world))]
    whole.sort(key=lambda e: e[0], reverse=True)  # of two restarts' saves of one (epoch, step), the later first
    return [os.path.relpath(path, run_dir) for _, path in whole]


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


def get_json(url: str, path: str, timeout: float, not_found: object = OracleError) -> object:
    """``GET url+path`` (read scope: ``CKPTD_TOKEN``) as JSON: :class:`OracleUnavailable` when ckptd
    cannot be asked now, :class:`OracleError` for any other failure (a refused token, a 4xx, not JSON)
    -- except ckptd's own 404 ``not_found`` when ``not_found`` is given: that is returned instead."""
    target = f"{url.rstrip('/')}{path}"
    try:
        return _get_json(target, timeout)
    except urllib.error.HTTPError as err:
        if err.code == 404 and not_found is not OracleError and _error_code(err) == "not_found":
            return not_found
        if is_transient(err):
            raise OracleUnavailable(f"ckptd answered HTTP {err.code} to GET {target}") from None
        raise OracleError(f"ckptd answered HTTP {err.code} to GET {target}") from None
    except ValueError as err:
        raise OracleError(f"ckptd: malformed answer to GET {target} (not JSON: {err})") from None
    except Exception as err:  # noqa: BLE001 -- classified: transient (ask again) or not
        if is_transient(err):
            raise OracleUnavailable(f"ckptd unreachable: {_reason(err)}") from None
        raise OracleError(f"GET {target} failed: {type(err).__name__}: {err}") from None


def _error_code(err: urllib.error.HTTPError) -> str | None:
    try:
        detail = json.loads(err.read()).get("detail")
    except (ValueError, AttributeError, OSError, http.client.HTTPException):
        return None
    return detail.get("code") if isinstance(detail, dict) else None


# --- the settled barrier: has ckptd judged everything committed up to now? ------------------------


@dataclass(frozen=True)
class Settled:
    settled: bool
    waited: float
    #: the run's newest steps as ckptd judged them, newest first, down to the newest verified one:
    #: (the step as users count it, :func:`ckptd.stepname.label`; its state)
    steps: list[tuple[str, str]] = field(default_factory=list)
    #: what held the barrier, in words ("" once settled)
    outstanding: str = ""


#: the longest one question to the barrier waits (a proxy in front of ckptd may cut longer requests)
SETTLE_CHUNK = 30.0


def wait_settled(url: str, run: str, timeout: float) -> Settled:
    """Wait (at most ``timeout`` s) until ckptd has judged everything committed under ``run`` up to
    now: ``GET /v1/runs/{run}/settled`` (read scope; :mod:`ckptd.service.settled`), which answers
    from ckptd's own ingest and verification, for every layout and format.

    The job was just stopped: its last save may have been renamed a moment ago and ckptd (settling,
    verifying) not have caught up. Asking the oracle right away would be answered -- safely -- with
    an older step and lose work. ckptd stays the judge of what is restorable either way.

    Raises :class:`OracleUnavailable` when ckptd cannot be asked (the launcher waits with back-off
    and logs it), :class:`OracleError` for a refused token or an answer that is not one."""
    t0 = time.monotonic()
    while True:
        wait = max(0.0, min(SETTLE_CHUNK, timeout - (time.monotonic() - t0)))
        doc = get_json(url, f"/v1/runs/{run}/settled?wait={wait:.3f}", timeout=wait + 30.0, not_found=None)
        if doc is None:  # after a rescan, nothing under ckptd's root holds the run: nothing to judge
            return Settled(True, time.monotonic() - t0)
        try:
            settled = doc["settled"] is True  # type: ignore[index]
            steps = [(str(s["label"]), str(s["state"])) for s in doc["steps"]]  # type: ignore[index]
            outstanding = "" if settled else _outstanding(doc)  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as err:
            raise OracleError(f"ckptd: malformed answer to GET /v1/runs/{run}/settled ({err!r})") from None
        waited = time.monotonic() - t0
        if settled or waited >= timeout:
            return Settled(settled, waited, steps, outstanding)


def _outstanding(doc: dict) -> str:
    said = []
    if not doc.get("rescanned"):
        said.append(f"node {doc.get('node')}: its rescan since the question has not finished")
    if doc.get("examining"):
        said.append(f"node {doc.get('node')}: {doc['examining']} paths wait for examination")
    for u in doc.get("unjudged") or []:
        if isinstance(u, dict) and u.get("blocking"):
            said.append(f"node {u.get('node')}: {u.get('shards')} shards without a verdict "
                        f"(steps {', '.join(map(str, (u.get('steps') or [])[:5]))})")
    return "; ".join(said)


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
    a :class:`ckptd.split.ParallelSplit`'s text): returns the background job's id."""
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
