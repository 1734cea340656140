"""``create_app(settings)``: the FastAPI application. No module-level state; the lifespan owns the
daemon (watcher + verifier) and the job runner, and stops them on shutdown."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI

from ckptd import __version__
from ckptd.api import errors, routes_conversions, routes_resume, routes_runs, routes_system
from ckptd.daemon import Daemon
from ckptd.service.jobs import JobRunner
from ckptd.service.resume import ResumeCache
from ckptd.settings import Settings


def create_app(settings: Settings, *, daemon: Daemon | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        d = daemon or Daemon(settings)
        app.state.daemon = d
        app.state.sessions = d.sessions
        app.state.jobs = JobRunner(d.sessions, d.ingestor.examine_many, d.verifier.verify_shards, d.verifier.check_step)
        app.state.started = time.monotonic()
        app.state.resume_cache.bind(d.engine)
        d.start()
        try:
            yield
        finally:
            app.state.jobs.close()
            app.state.resume_cache.close()
            d.stop()

    app = FastAPI(
        title="ckptd",
        version=__version__,
        description="Checkpoint catalog, verification and resume oracle for MindSpore training.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.tokens = settings.all_tokens()
    app.state.resume_cache = ResumeCache()
    app.state.resume_locks = {}  # one computation per resume question at a time (routes_resume)
    errors.install(app)
    app.add_middleware(routes_resume.ResumeFastPath)  # cached resume answers without the FastAPI stack
    app.include_router(routes_runs.router)
    app.include_router(routes_resume.router)
    app.include_router(routes_conversions.router)
    app.include_router(routes_system.router)
    return app
