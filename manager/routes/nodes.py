from fastapi import APIRouter

from manager.cluster.views import NodeView
from manager.deps import MetricsDep, SupervisorDep

router = APIRouter(prefix="/api", tags=["nodes"])


@router.get("/nodes")
def list_nodes(sup: SupervisorDep, collector: MetricsDep) -> list[NodeView]:
    """The boxes workers run on: each Ray node (or, without a cluster, this box) with its state,
    GPUs, RAM, /dev/shm and workers."""
    latest = collector.latest
    return sup.nodes(latest.host if latest else None, latest.gpu if latest else None)
