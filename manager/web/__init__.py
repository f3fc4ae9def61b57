"""The dashboard: pages (Jinja2 + htmx), the SSE metrics stream, /metrics and /api/metrics.

``install(app)`` adds the routes and /static; ``start_metrics``/``stop_metrics`` run the collector
in the app's lifespan. Everything here translates; the numbers come from manager.metrics.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from sqlalchemy.engine import Engine

from manager.db import session
from manager.metrics import ManagerExposition, MetricsCollector
from manager.services import models
from manager.settings import Settings
from manager.web import lora_pages, metrics_api, model_pages, pages
from manager.web.live import LiveViews
from manager.web.paths import static_dir
from manager.web.wiring import make_collector


def install(app: FastAPI) -> None:
    for module in (metrics_api, pages, model_pages, lora_pages):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=static_dir()), name="static")


def start_metrics(app: FastAPI, settings: Settings, engine: Engine, supervisor) -> MetricsCollector:
    collector = make_collector(settings, engine, supervisor)

    def model_names() -> list[str]:
        with session(engine) as db:
            return [m.name for m in models.list_models(db)]

    app.state.metrics = collector
    app.state.exposition = ManagerExposition(lambda: collector.latest)
    app.state.live_views = LiveViews(model_names)
    collector.start()
    return collector


async def stop_metrics(app: FastAPI) -> None:
    await app.state.metrics.stop()
