from fastapi import APIRouter, Response

from manager.deps import SessionDep
from manager.openapi import errors
from manager.schemas.offload_profile import (
    OffloadProfileCreate,
    OffloadProfilePublic,
    OffloadProfileUpdate,
)
from manager.services import profiles

router = APIRouter(prefix="/api/profiles", tags=["offload profiles"])


@router.get("", response_model=list[OffloadProfilePublic])
def list_profiles(db: SessionDep):
    return [profiles.to_public(p) for p in profiles.list_profiles(db)]


@router.post("", response_model=OffloadProfilePublic, status_code=201, responses=errors(409))
def create_profile(data: OffloadProfileCreate, db: SessionDep):
    return profiles.to_public(profiles.create_profile(db, data))


@router.get("/{name}", response_model=OffloadProfilePublic, responses=errors(404))
def get_profile(name: str, db: SessionDep):
    return profiles.to_public(profiles.get_profile(db, name))


@router.put("/{name}", response_model=OffloadProfilePublic, responses=errors(404))
def replace_profile(name: str, data: OffloadProfileUpdate, db: SessionDep):
    return profiles.to_public(profiles.replace_profile(db, name, data))


@router.delete("/{name}", status_code=204, responses=errors(404, 409))
def delete_profile(name: str, db: SessionDep) -> Response:
    profiles.delete_profile(db, name)
    return Response(status_code=204)
