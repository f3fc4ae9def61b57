"""HTTP for downloads from the Hugging Face Hub: translate requests and errors, nothing else."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field

from manager.deps import MAX_ROW_ID, DownloadsDep
from manager.hub.downloads import public
from manager.openapi import errors
from manager.schemas.download import DownloadRequest

router = APIRouter(prefix="/api/downloads", tags=["downloads"])
DownloadId = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="The download's id")]

_HUB = {
    "_403": "The repo is gated or private and the manager's HF_TOKEN may not read it (the message says what to do)",
    "_404": "No such repo or revision on the hub, or no download of that id",
    "_409": "HF_HUB_OFFLINE is set for the manager, or the download is not in a state that allows this",
    "_502": "The Hugging Face Hub did not answer",
    "_507": "The files need more room than the cache's disk has free (both numbers in the message)",
}


class DownloadPublic(BaseModel):
    id: int
    repo: str
    revision: str
    commit: str | None
    cache_dir: str = Field(description="The Hugging Face hub cache it downloads into")
    files: int = Field(description="How many files: the weights vLLM loads, its config and tokenizer")
    total_bytes: int
    done_bytes: int
    percent: int
    rate_bps: float | None = Field(description="Bytes per second over the last seconds, while it runs")
    eta_s: float | None
    state: str = Field(description="queued, running, done, failed or cancelled")
    error: str | None
    created_at: Any
    updated_at: Any
    finished_at: Any | None


@router.get("", response_model=list[DownloadPublic])
def list_downloads(downloads: DownloadsDep) -> list[dict]:
    """Downloads under way and the latest finished ones, newest first, with their progress."""
    return [public(row, downloads.rate(row.id or 0)) for row in downloads.list()]


@router.post(
    "",
    response_model=DownloadPublic,
    status_code=202,
    responses=errors(403, 404, 409, 422, 502, 507, **_HUB),
)
async def start_download(body: DownloadRequest, downloads: DownloadsDep) -> dict:
    """Download the files vLLM loads for a model (safetensors weights, config, tokenizer) into the manager's
    Hugging Face cache; the one already under way for the same repo is returned instead of a second."""
    row = await downloads.start(body.repo, body.revision)
    return public(row, downloads.rate(row.id or 0))


@router.get("/{download_id}", response_model=DownloadPublic, responses=errors(404))
def get_download(download_id: DownloadId, downloads: DownloadsDep) -> dict:
    row = downloads.get(download_id)
    return public(row, downloads.rate(download_id))


@router.post("/{download_id}/cancel", response_model=DownloadPublic, responses=errors(404, 409, **_HUB))
async def cancel_download(download_id: DownloadId, downloads: DownloadsDep) -> dict:
    """Stop a download; what is on disk stays, and resume goes on from there."""
    row = await downloads.cancel(download_id)
    return public(row, None)


@router.post("/{download_id}/resume", response_model=DownloadPublic, responses=errors(404, 409, **_HUB))
async def resume_download(download_id: DownloadId, downloads: DownloadsDep) -> dict:
    """Go on with a cancelled or failed download, from the bytes already on disk."""
    row = await downloads.resume(download_id)
    return public(row, downloads.rate(download_id))
