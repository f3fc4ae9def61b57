"""Inference API keys for /v1. HTTP only."""

from __future__ import annotations

from fastapi import APIRouter, Response

from manager.deps import SessionDep
from manager.openapi import errors
from manager.schemas.inference_key import InferenceKeyCreate, InferenceKeyCreated, InferenceKeyPublic
from manager.services import inference_keys

router = APIRouter(prefix="/api", tags=["inference keys"])


@router.get("/keys")
def list_keys(db: SessionDep) -> list[InferenceKeyPublic]:
    """Every key, active ones first; never the key itself (only its first characters)."""
    return [inference_keys.to_public(k) for k in inference_keys.list_keys(db)]


@router.post("/keys", status_code=201, responses=errors(409, 422))
def create_key(body: InferenceKeyCreate, db: SessionDep) -> InferenceKeyCreated:
    """Make a key for /v1. The answer holds the key itself, this once: only its hash is stored."""
    return inference_keys.create_key(db, body)


@router.delete("/keys/{name}", status_code=204, responses=errors(404))
def revoke_key(name: str, db: SessionDep) -> Response:
    """Revoke the active key of this name: /v1 refuses it from now on; its usage stays."""
    inference_keys.revoke_key(db, name)
    return Response(status_code=204)
