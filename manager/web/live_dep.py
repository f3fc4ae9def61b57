"""The dashboard's live views as a route dependency: one per running manager, built from its runtime
the first time a page or the stream asks, and shared by every browser after."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from manager.db import session
from manager.deps import RuntimeDep
from manager.hub.downloads import Downloads, public
from manager.runtime import Runtime
from manager.services import models
from manager.web.live import LiveViews


def live_views_of(runtime: Runtime) -> LiveViews:
    def model_names() -> list[str]:
        with session(runtime.engine) as db:
            return [m.name for m in models.list_models(db)]

    return LiveViews(model_names, lambda: downloads_shown(runtime.downloads))


def downloads_shown(downloads: Downloads) -> tuple[int, list[dict]]:
    return downloads.version, [public(row, downloads.rate(row.id or 0)) for row in downloads.list()]


async def get_live_views(request: Request, runtime: RuntimeDep) -> LiveViews:
    built = getattr(request.app.state, "live_views", None)
    if built is None or built[0] is not runtime:  # a manager started again in the same process
        built = (runtime, live_views_of(runtime))
        request.app.state.live_views = built
    return built[1]


LiveViewsDep = Annotated[LiveViews, Depends(get_live_views)]
