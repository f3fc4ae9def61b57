"""The FastAPI application: routes, error handlers and middleware. Its parts are built in manager.runtime."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from manager import __version__, error_responses, openapi, web
from manager.audit.trail import AuditTrail
from manager.deps import InferenceRoute, require_admin_access
from manager.inference_endpoints import JSON_ENDPOINTS, MULTIPART_ENDPOINTS, is_front_door
from manager.middleware import BodyLimit, FramingForbidden, HeadAsGet, TrustedHosts
from manager.routes import (
    audit,
    cache,
    docs,
    downloads,
    health,
    keys,
    loras,
    models,
    nodes,
    plan,
    profiles,
    sessions,
    transfer,
    usage,
    v1,
    workers,
)
from manager.runtime import Runtime
from manager.settings import Settings


def create_app(settings: Settings | None = None, *, freeze_heap: bool = False) -> FastAPI:
    """The manager's app. ``freeze_heap``: for the process that serves it (``vllm-manager serve``), not
    for one that makes many apps (tests): what the start made is kept out of the garbage collector's
    full passes, and so never collected."""
    settings = settings or Settings()
    _ = settings.env_token  # a token file that cannot be read stops the start, not every later call

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = await Runtime.open(settings)
        app.state.runtime = runtime
        if freeze_heap:
            # Everything made so far (modules, the app, the runtime) lives as long as the process: left
            # out of the garbage collector's full passes, which otherwise walk it all every few seconds
            # under /v1 load and stall every stream for 130 ms at a time (bench/README.md). vLLM's API
            # server does the same after its start.
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            await runtime.close()

    app = FastAPI(
        title="vllm-manager",
        version=__version__,
        description="Supervise vLLM servers, plan their memory honestly, and watch them live.",
        lifespan=lifespan,
        dependencies=[Depends(require_admin_access)],
        # Served by manager.routes.docs instead, under the same rule as every other read.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )

    app.add_middleware(TrustedHosts, allowed_hosts=settings.trusted_hosts())
    app.add_middleware(
        BodyLimit,
        default=settings.max_body_bytes,
        by_path={
            "/api/import": (settings.max_import_bytes, "VLLM_MANAGER_MAX_IMPORT_BYTES"),
            # Inference bodies (audio uploads above all): the front door enforces its own limit.
            **dict.fromkeys((*JSON_ENDPOINTS, *MULTIPART_ENDPOINTS)),
        },
    )
    # Around the two checks above, which refuse before any route runs, so their refusals are recorded
    # too; the routes' own answers it sees after routing, refusals included.
    app.add_middleware(
        AuditTrail,
        skip=(InferenceRoute,),
        skip_path=is_front_door,
        max_body=max(settings.max_body_bytes, settings.max_import_bytes),
    )
    app.add_middleware(HeadAsGet)
    app.add_middleware(FramingForbidden)  # the outermost: every answer carries it, refusals included

    error_responses.install(app)
    # /v1 first: a route is found by trying each in turn, and /v1 takes the most requests by far.
    for module in (
        v1,
        health,
        docs,
        models,
        profiles,
        transfer,
        workers,
        nodes,
        plan,
        loras,
        keys,
        sessions,
        usage,
        downloads,
        audit,
    ):
        app.include_router(module.router)
    app.include_router(cache.router)
    app.include_router(v1.not_served)
    web.install(app)
    openapi.install(app, settings)
    return app
