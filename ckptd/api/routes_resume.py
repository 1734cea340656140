"""/v1/runs/{run}/resume and /health: the launcher's and the trainer's endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd.api.deps import (
    INT32_MAX, INT64_MAX, SCOPE_RANK, AdminScope, ReadScope, ReportScope, RunName, SessionDep, token_scope,
    valid_run_name,
)
from ckptd.api.errors import responses
from ckptd.api.guard import DEFAULT_MAX_BODY, max_body
from ckptd.api.schemas import HealthCleared, HealthReport, ResumeAnswer
from ckptd.service import health
from ckptd.service.resume import ResumeOptions
from ckptd.service.resume_cache import ResumeCache
from ckptd.split import parse_split
from ckptd.states import Tier

router = APIRouter(prefix="/v1/runs", tags=["resume"], responses=responses(400, 401, 403, 422))


@router.get(
    "/{run}/resume",
    response_model=ResumeAnswer,
    responses=responses(described={404: "no restorable step (detail.code no_restorable_step, detail.skipped lists "
                                        "why), or a run ckptd has never seen (detail.code not_found)"}),
)
async def get_resume(
    run: RunName, _: ReadScope, request: Request,
    max_step: int | None = Query(default=None, ge=0, le=INT64_MAX, description="resume at or before this step"),
    world_size: int | None = Query(default=None, ge=1, le=INT32_MAX,
                                   description="target world size; a mismatch sets 'conversion'"),
    skip_spikes: bool = Query(default=False, description="also skip steps from the first loss spike on"),
    spike_factor: float = Query(default=3.0, gt=1.0, allow_inf_nan=False),
    spike_window: int = Query(default=20, ge=2, le=INT32_MAX),
    lease: bool = Query(default=True, description="protect the answer from retention for 30 minutes"),
    strategy_hash: str | None = Query(
        default=None, max_length=80, pattern=r"^(none|sha256:[0-9a-f]{64})$",
        description="target layout's strategy hash (as answers report it); a mismatch sets 'conversion' even at the "
                    "same world size, and 'existing' is a copy of exactly that layout",
    ),
    exclude_unreachable: bool = Query(
        default=False, description="pass over steps with a shard on a node whose daemon is silent (after a node loss)"),
    split: str | None = Query(
        default=None, max_length=40, pattern=r"^tp=[1-9][0-9]{0,6},dp=[1-9][0-9]{0,6}(,pp=[1-9][0-9]{0,6})?$",
        description="the job's split tp=..,dp=..[,pp=..]: 'conversion' says whether the step must be re-sharded for "
                    "it, to which strategy hash (derived from the strategy the step was saved with), and the ready "
                    "copy of exactly that layout"),
    tiers: str = Query(
        default="file,memory,object", max_length=20, pattern=r"^(file|memory|object)(,(file|memory|object)){0,2}$",
        description="the tiers the asker can load from: with memory, a step whole in the nodes' shared memory is "
                    "answered from there (tier: memory, each rank's slot); file only for a job that loads files "
                    "(MindFormers' own resume); with object, a step whose files are gone but whose objects are whole "
                    "is answered tier: object (the launcher fetches it first)"),
) -> Response:
    """The latest restorable step: every shard verified, not marked bad, training healthy."""
    settings = request.app.state.settings
    opts = ResumeOptions(max_step, world_size, skip_spikes, spike_factor, spike_window, lease, strategy_hash,
                         exclude_unreachable, settings.node_timeout,
                         parse_split(split, "split") if split is not None else None,
                         settings.allow_hardlinks, tuple(Tier(t) for t in dict.fromkeys(tiers.split(","))),
                         str(settings.memory_root) if settings.memory_root is not None else None)
    # Cached answers are normally served by ResumeFastPath below before FastAPI sees the request;
    # here: the first request after a change, or unusual query strings. A cache hit costs one
    # indexed lookup of the run's generation (ResumeCache.current, no ORM session); a miss is
    # computed in the thread pool. Answers are pre-serialized and not re-validated — the service
    # builds exactly ResumeAnswer's keys (tests pin them).
    cache = request.app.state.resume_cache
    body = await cache.current(run, opts)
    if body is None:
        # One computation per question at a time: a restart storm on a cold cache would otherwise
        # compute the same answer once per rank. Whoever waited re-checks the cache afterwards
        # (the generation lookup again), so it never takes an answer older than its own arrival.
        async with _one_at_a_time(request.app.state, (run, opts)):
            body = await cache.current(run, opts)
            if body is None:
                body = await run_in_threadpool(_compute, request.app.state.sessions, cache, run, opts)
    return Response(body, media_type="application/json")


@contextlib.asynccontextmanager
async def _one_at_a_time(state: Any, key: tuple) -> AsyncIterator[None]:
    locks: dict[tuple, list] = state.resume_locks  # key -> [lock, users]; only touched on the event loop
    entry = locks.setdefault(key, [asyncio.Lock(), 0])
    entry[1] += 1
    try:
        async with entry[0]:
            yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del locks[key]


def _compute(sessions: sessionmaker[Session], cache: ResumeCache, run: str, opts: ResumeOptions) -> bytes:
    with sessions.begin() as s:
        return cache.answer(s, run, opts)


_HEALTH_BODY = 4 * 1024  # {"step", "loss", "grad_norm", "overflow"}: well under 200 bytes


@router.post(
    "/{run}/health", status_code=204, response_class=Response, openapi_extra=max_body(_HEALTH_BODY),
    responses=responses(413, described={404: "ckptd has not seen this run on disk (detail.code not_found): "
                                             "<root>/<run> is not a directory"}),
)
def post_health(run: RunName, body: HealthReport, request: Request, s: SessionDep, _: ReportScope) -> Response:
    """One step's training health from the trainer (the last report of a step wins).

    A run is created only for a directory that exists under the checkpoint root: a report token
    cannot make ckptd invent runs. A NaN/inf loss rules out every checkpoint at or after its step;
    an operator clears a wrong one with ``DELETE /v1/runs/{run}/health``.
    """
    health.report(s, request.app.state.settings.storage, run, body.step, body.loss, body.grad_norm, body.overflow)
    return Response(status_code=204)


@router.delete("/{run}/health", response_model=HealthCleared, openapi_extra=max_body(DEFAULT_MAX_BODY),
               responses=responses(413, described={404: "no run of that name in the catalog (detail.code not_found)"}))
def clear_health(
    run: RunName, s: SessionDep, _: AdminScope,
    from_step: int | None = Query(default=None, ge=0, le=INT64_MAX,
                                  description="remove the records of this step and later ones (default: all)"),
) -> dict[str, Any]:
    """Remove a run's training-health records (e.g. a NaN reported by mistake): the steps they ruled
    out are restorable again, the resume answer follows at once."""
    return health.clear(s, run, from_step)


# --- the restart-storm fast path -----------------------------------------------------------------

_PREFIX, _SUFFIX = "/v1/runs/", "/resume"
_BOOLS = {"true": True, "false": False}


def _canonical_int(value: str, minimum: int) -> int | None:
    n = int(value) if value.isascii() and value.isdigit() and len(value) < 19 else None
    return n if n is not None and n >= minimum and str(n) == value else None


def _fast_options(query: bytes) -> ResumeOptions | None:
    """ResumeOptions from a query string in its plain form only; None means "let FastAPI decide".

    Deliberately narrower than FastAPI's parsing (canonical integers, true/false, no spike
    options, no unknown or repeated keys): whatever it accepts parses to the same options in the
    documented route, and a cached entry exists only for options that route already validated.
    """
    if not query:
        return ResumeOptions()
    fields: dict[str, int | bool | None] = {}
    for key, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if key in fields:
            return None
        if key in ("max_step", "world_size"):
            fields[key] = _canonical_int(value, 0 if key == "max_step" else 1)
        elif key == "lease":
            fields[key] = _BOOLS.get(value)
        else:
            return None
        if fields[key] is None:
            return None
    return ResumeOptions(**fields)  # type: ignore[arg-type]


class ResumeFastPath:
    """ASGI middleware answering ``GET /v1/runs/{run}/resume`` from the cache without entering FastAPI.

    After a failure every rank's launcher asks at once. FastAPI's per-request work (routing,
    dependency solving, parameter validation: ~0.5 ms) dwarfs a cache hit (one indexed lookup), so
    a request that is plainly well-formed, carries a token with the read scope and has a current
    cached answer is served here. Everything else — a miss, an unusual query string, a missing or
    wrong token, an invalid run name — goes on to the documented route, which is the only place
    that computes answers and produces errors.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            path: str = scope["path"]
            if path.startswith(_PREFIX) and path.endswith(_SUFFIX):
                await self._resume(scope, receive, send, path[len(_PREFIX):-len(_SUFFIX)])
                return
        await self.app(scope, receive, send)

    async def _resume(self, scope: Scope, receive: Receive, send: Send, run: str) -> None:
        """Answer from the cache or pass on to the route; either way the answer's latency is
        observed here, where every resume request starts and ends (/metrics)."""
        t0 = time.perf_counter()
        metrics = scope["app"].state.daemon.metrics
        body = await self._cached(scope, run)
        # the latency ends when the answer is handed to the server, not when the event loop comes
        # back to this task afterwards (under load that can be after the client has it)
        if body is not None:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]})
            done = time.perf_counter()
            await send({"type": "http.response.body", "body": body})
            metrics.resume_answered(done - t0, "cache", 200)
            return
        status = 500  # what the server answers if the route raises past every handler
        done = None

        async def sent(message: Message) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                done = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            metrics.resume_answered((done or time.perf_counter()) - t0, "route", status)

    @staticmethod
    async def _cached(scope: Scope, run: str) -> bytes | None:
        if not valid_run_name(run):
            return None
        state = scope["app"].state
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        granted = token_scope(state.tokens, authorization.decode("latin-1"))
        if SCOPE_RANK.get(granted, -1) < SCOPE_RANK["read"]:  # type: ignore[arg-type]
            return None  # the route says why a token was refused
        opts = _fast_options(scope.get("query_string", b""))
        if opts is None:
            return None
        # as the route builds them
        root = state.settings.memory_root
        opts = replace(opts, node_timeout=state.settings.node_timeout, hardlinks=state.settings.allow_hardlinks,
                       memory_root=str(root) if root is not None else None)
        body = await state.resume_cache.current(run, opts)
        if body is None and (run, opts) in state.resume_locks:
            # the same answer is being computed (the storm after a change): wait for it here rather
            # than queue in the route, and take it only if it is current (current() looks again)
            async with _one_at_a_time(state, (run, opts)):
                body = await state.resume_cache.current(run, opts)
        return body
