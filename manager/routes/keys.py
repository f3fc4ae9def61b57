"""Inference API keys for /v1. HTTP only."""

from __future__ import annotations

from fastapi import APIRouter, Response

from manager.deps import SessionDep
from manager.openapi import errors
from manager.schemas.inference_key import (
    InferenceAccessPublic,
    InferenceKeyCreate,
    InferenceKeyCreated,
    InferenceKeyPublic,
    KeyLimitsUpdate,
)
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


@router.patch("/keys/{name}", responses=errors(404, 422))
def set_key_limits(name: str, body: KeyLimitsUpdate, db: SessionDep) -> InferenceKeyPublic:
    """Change an active key's limits, expiry or priority: the fields sent change (null: no limit), the
    others stay. /v1 counts by the new limits from its next request on."""
    return inference_keys.to_public(inference_keys.set_limits(db, name, body))


@router.get("/v1-access")
def v1_access(db: SessionDep) -> InferenceAccessPublic:
    """Whether /v1 takes only inference keys now, and who may use it, in words."""
    return inference_keys.access_now(db)


@router.post("/v1-access/open", responses=errors(409))
def open_v1(db: SessionDep) -> InferenceAccessPublic:
    """Let /v1 be used without a key again, as before any key was made (once a key was made, revoking the
    last one leaves /v1 closed). 409 while a key is active; making a key closes /v1 again."""
    return inference_keys.open_without_keys(db)


@router.delete("/keys/{name}", status_code=204, responses=errors(404))
def revoke_key(name: str, db: SessionDep) -> Response:
    """Revoke the active key of this name: /v1 refuses it from now on; its usage stays."""
    inference_keys.revoke_key(db, name)
    return Response(status_code=204)
