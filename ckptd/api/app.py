"""``create_app(settings)``: the FastAPI application. No module-level state; the lifespan owns the
daemon (watcher + verifier + job runner) and stops it on shutdown."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI

from ckptd import __version__
from ckptd.api import deps, errors, guard, methods, routes_conversions, routes_nodes, routes_resume, routes_runs, routes_system
from ckptd.api import routes_page  # the status page (HTML at / and /runs/{run})
from ckptd.daemon import Daemon
from ckptd.service.resume_cache import ResumeCache
from ckptd.settings import Settings


def preflight(settings: Settings) -> None:
    """What the daemon would refuse at start, refused before the server starts: an error raised in
    the lifespan reaches the operator as uvicorn's traceback and "Application startup failed"."""
    from ckptd.catalog.db import make_engine, require_current_schema
    from ckptd.errors import CkptdError

    if not os.path.isdir(settings.root):
        raise CkptdError("checkpoint root is not a directory", path=str(settings.root), hint="create it or pass --root")
    engine = make_engine(settings.db)
    try:
        require_current_schema(engine)
    finally:
        engine.dispose()


def create_app(settings: Settings, *, daemon: Daemon | None = None) -> FastAPI:
    """The application; without ``daemon``, ``preflight`` checks the settings first."""
    if daemon is None:
        preflight(settings)
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        d = daemon or Daemon(settings)
        app.state.daemon = d
        app.state.sessions = d.sessions
        app.state.resume_cache.bind(d.engine)
        d.start()
        try:
            yield
        finally:
            app.state.resume_cache.close()
            d.stop()

    app = FastAPI(
        title="ckptd",
        version=__version__,
        description="Checkpoint catalog, verification and resume oracle for MindSpore training.",
        lifespan=lifespan,
        dependencies=[Depends(deps.known_query_only)],
    )
    app.state.settings = settings
    app.state.tokens = settings.all_tokens()
    app.state.resume_cache = ResumeCache()
    app.state.resume_locks = {}  # one computation per resume question at a time (routes_resume)
    errors.install(app)
    app.add_middleware(routes_resume.ResumeFastPath)  # cached resume answers without the FastAPI stack
    routers = (routes_runs.router, routes_resume.router, routes_conversions.router, routes_system.router,
               routes_nodes.router, routes_page.router)
    # bodies: the token is checked before one is read, and its size capped per route
    declared = [route for router in routers for route in router.routes]
    app.add_middleware(guard.RequestGuard, routes=declared)
    # every method of a path for OPTIONS and 405's Allow (the docs routes are the app's own)
    app.state.methods = methods.MethodTable([*app.routes, *declared])
    app.add_middleware(methods.OptionsAnswer, table=app.state.methods)  # outermost: no body, no token
    for router in routers:
        app.include_router(router)
    return app
