"""The dashboard: pages (Jinja2 + htmx), the login page, the SSE metrics stream, /metrics and /api/metrics.

``install(app)`` adds the routes and /static. Everything here translates; the numbers come from
manager.metrics, the parts from manager.runtime.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from manager.web import (
    audit_pages,
    disk_pages,
    key_pages,
    login,
    lora_pages,
    metrics_api,
    model_pages,
    node_pages,
    pages,
)
from manager.web.paths import static_dir


def install(app: FastAPI) -> None:
    for module in (metrics_api, pages, model_pages, disk_pages, lora_pages, key_pages, node_pages, audit_pages):
        app.include_router(module.router)
    login.install(app)
    app.mount("/static", StaticFiles(directory=static_dir()), name="static")
