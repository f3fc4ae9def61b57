from fastapi import APIRouter

from manager import __version__

router = APIRouter(tags=["health"])


@router.get("/api/health")
def health() -> dict:
    return {"status": "ok", "version": __version__}
