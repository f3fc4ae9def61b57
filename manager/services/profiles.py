"""Offload profiles: create, read, replace, delete."""

from __future__ import annotations

from sqlmodel import Session, select

from manager.db import commit_or_conflict
from manager.errors import Conflict, NotFound
from manager.schemas.common import utcnow
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import (
    OffloadProfile,
    OffloadProfileCreate,
    OffloadProfileFields,
    OffloadProfilePublic,
)


def list_profiles(db: Session) -> list[OffloadProfile]:
    return list(db.exec(select(OffloadProfile).order_by(OffloadProfile.name)))


def get_profile(db: Session, name: str) -> OffloadProfile:
    profile = db.exec(select(OffloadProfile).where(OffloadProfile.name == name)).first()
    if profile is None:
        raise NotFound(f"no offload profile named {name!r}")
    return profile


def create_profile(db: Session, data: OffloadProfileCreate) -> OffloadProfile:
    if db.exec(select(OffloadProfile).where(OffloadProfile.name == data.name)).first():
        raise Conflict(f"an offload profile named {data.name!r} already exists")
    profile = OffloadProfile.model_validate(data.model_dump())
    db.add(profile)
    commit_or_conflict(db, f"an offload profile named {data.name!r} already exists")
    db.refresh(profile)
    return profile


def replace_profile(db: Session, name: str, data: OffloadProfileFields) -> OffloadProfile:
    profile = get_profile(db, name)
    for key, value in data.model_dump().items():
        setattr(profile, key, value)
    profile.updated_at = utcnow()
    db.add(profile)
    db.commit()
    db.refresh(profile)
    return profile


def users_of(db: Session, profile: OffloadProfile) -> list[str]:
    rows = db.exec(select(ModelConfig.name).where(ModelConfig.offload_profile_id == profile.id))
    return sorted(rows)


def delete_profile(db: Session, name: str) -> None:
    profile = get_profile(db, name)
    users = users_of(db, profile)
    if users:
        raise Conflict(
            f"offload profile {name!r} is used by model configs {', '.join(users)}; "
            "point them at another profile (or none) first",
            users=users,
        )
    db.delete(profile)
    commit_or_conflict(
        db, f"offload profile {name!r} was just chosen by a model config; point it at another profile (or none) first"
    )


def to_public(profile: OffloadProfile) -> OffloadProfilePublic:
    return OffloadProfilePublic.model_validate(profile.model_dump())
