"""The dashboard's live views as a route dependency: the runtime builds them (``Runtime.live_views``),
the pages and the stream take them from here."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends

from manager.deps import RuntimeDep
from manager.web.live import LiveViews


async def get_live_views(runtime: RuntimeDep) -> LiveViews:
    return runtime.live_views


LiveViewsDep = Annotated[LiveViews, Depends(get_live_views)]
