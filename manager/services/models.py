"""Model configs: create, read, replace, delete, with the offload profile named by its name."""

from __future__ import annotations

from sqlmodel import Session, col, select

from manager.db import commit_or_conflict
from manager.errors import Conflict, NotFound
from manager.launch.refusals import check_env, check_extra_args
from manager.schemas.common import utcnow
from manager.schemas.model_config import (
    ModelConfig,
    ModelConfigCreate,
    ModelConfigIn,
    ModelConfigPublic,
)
from manager.schemas.offload_profile import OffloadProfile
from manager.services import profiles
from manager.supervisor.lifecycle import ACTIVE


def list_models(db: Session) -> list[ModelConfig]:
    return list(db.exec(select(ModelConfig).order_by(ModelConfig.name)))


def get_model(db: Session, name: str) -> ModelConfig:
    config = db.exec(select(ModelConfig).where(ModelConfig.name == name)).first()
    if config is None:
        raise NotFound(f"no model config named {name!r}")
    return config


def profile_of(db: Session, config: ModelConfig) -> OffloadProfile | None:
    if config.offload_profile_id is None:
        return None
    return db.get(OffloadProfile, config.offload_profile_id)


def _fields(db: Session, data: ModelConfigIn, allow_code_flags: bool) -> dict:
    check_extra_args(data.extra_args, allow_code_flags)
    check_env(data.env, allow_code_flags)
    fields = data.model_dump(exclude={"offload_profile", "name"})
    fields["offload_profile_id"] = profiles.get_profile(db, data.offload_profile).id if data.offload_profile else None
    return fields


def create_model(db: Session, data: ModelConfigCreate, *, allow_code_flags: bool = False) -> ModelConfig:
    if db.exec(select(ModelConfig).where(ModelConfig.name == data.name)).first():
        raise Conflict(f"a model config named {data.name!r} already exists")
    config = ModelConfig(name=data.name, **_fields(db, data, allow_code_flags))
    db.add(config)
    commit_or_conflict(db, f"a model config named {data.name!r} already exists")
    db.refresh(config)
    return config


def replace_model(db: Session, name: str, data: ModelConfigIn, *, allow_code_flags: bool = False) -> ModelConfig:
    config = get_model(db, name)
    for key, value in _fields(db, data, allow_code_flags).items():
        setattr(config, key, value)
    config.updated_at = utcnow()
    db.add(config)
    commit_or_conflict(db, f"model config {name!r} changed meanwhile (its offload profile was removed?); try again")
    db.refresh(config)
    return config


def delete_model(db: Session, name: str) -> None:
    from manager.schemas.worker import Worker

    config = get_model(db, name)
    # A worker that holds (or will soon hold) an engine needs its config.
    active = [state.value for state in ACTIVE]
    busy = db.exec(select(Worker.id).where(Worker.model_name == name, col(Worker.state).in_(active))).all()
    if busy:
        ids = ", ".join(str(i) for i in busy)
        raise Conflict(f"model config {name!r} is running in worker(s) {ids}; stop them first", workers=list(busy))
    db.delete(config)
    db.commit()


def to_public(db: Session, config: ModelConfig) -> ModelConfigPublic:
    profile = profile_of(db, config)
    return ModelConfigPublic.model_validate(
        {**config.model_dump(), "offload_profile": profile.name if profile else None}
    )
