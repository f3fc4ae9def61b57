"""The Nodes page: each box of the Ray cluster (or this box alone) with its GPUs, RAM and workers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from manager.deps import MetricsDep, SupervisorDep
from manager.web.render import render

router = APIRouter(include_in_schema=False)


@router.get("/nodes", response_class=HTMLResponse)
def nodes_page(sup: SupervisorDep, collector: MetricsDep) -> HTMLResponse:
    latest = collector.latest
    nodes = sup.nodes(latest.host if latest else None, latest.gpu if latest else None)
    clustered = sup.cluster is not None
    return HTMLResponse(render("nodes.html", page="nodes", nodes=nodes, clustered=clustered))
