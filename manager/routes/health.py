from fastapi import APIRouter

from manager import __version__
from manager.deps import OpenRoute

# Open to probes (Docker, systemd, load balancers) whether or not a token exists.
router = APIRouter(tags=["health"], route_class=OpenRoute)


@router.get("/api/health")
def health() -> dict:
    return {"status": "ok", "version": __version__}
