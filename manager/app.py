"""The FastAPI application: wiring only. Logic lives in manager.services and friends."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware

from manager import __version__, web
from manager.db import make_engine, migrate
from manager.deps import require_token_for_changes
from manager.errors import ManagerError
from manager.launch.preflight import refuse_if_it_cannot_fit
from manager.lora.pin_keeper import PinKeeper
from manager.routes import health, loras, models, plan, profiles, transfer, workers
from manager.settings import Settings
from manager.supervisor.supervisor import Supervisor


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    _ = settings.env_token  # a token file that cannot be read stops the start, not every later call

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.ensure_dirs()
        engine = make_engine(settings.db_path)
        migrate(engine)
        app.state.settings = settings
        app.state.engine = engine
        supervisor = Supervisor(settings, engine)
        supervisor.preflight = refuse_if_it_cannot_fit
        app.state.supervisor = supervisor
        await supervisor.start_up()
        web.start_metrics(app, settings, engine, supervisor)
        app.state.lora_pin_keeper = PinKeeper(engine, supervisor)
        app.state.lora_pin_keeper.start()
        try:
            yield
        finally:
            await app.state.lora_pin_keeper.stop()
            await web.stop_metrics(app)
            await supervisor.shut_down()
            engine.dispose()

    app = FastAPI(
        title="vllm-manager",
        version=__version__,
        description="Supervise vLLM servers, plan their memory honestly, and watch them live.",
        lifespan=lifespan,
        dependencies=[Depends(require_token_for_changes)],
    )

    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.trusted_hosts())

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # Field, rule and message only: echoing the input back can fail (Infinity is not JSON) and
        # would repeat secrets such as environment values.
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        return JSONResponse(status_code=422, content={"detail": errors})

    @app.exception_handler(ManagerError)
    async def _manager_error(_request: Request, exc: ManagerError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"detail": exc.message, **exc.detail})

    for module in (health, models, profiles, transfer, workers, plan, loras):
        app.include_router(module.router)
    web.install(app)
    return app
