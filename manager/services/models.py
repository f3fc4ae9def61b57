"""Model configs: create, read, replace, delete, with the offload profile named by its name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from manager.errors import Conflict, NotFound
from manager.hub.model_location import check_path_exists
from manager.launch.refusals import check_launch_fields
from manager.launch.secrets import keep_stored
from manager.schemas.common import utcnow
from manager.schemas.model_config import (
    ModelConfig,
    ModelConfigCreate,
    ModelConfigIn,
    ModelConfigPublic,
)
from manager.schemas.offload_profile import OffloadProfile
from manager.services import profiles, routing_names

if TYPE_CHECKING:
    from manager.settings import Settings


@dataclass(frozen=True)
class WriteRules:
    """What a config write is checked against besides its schema, from the manager's settings."""

    allow_code_flags: bool = False  # engine flags and environment that load code of the user's choosing
    local_paths: bool = True  # engines run on this machine (no Ray cluster): a model path must exist here

    @classmethod
    def of(cls, settings: Settings) -> WriteRules:
        return cls(allow_code_flags=settings.allow_code_flags, local_paths=settings.local_model_paths)


def check_own_names(name: str, data: ModelConfigIn) -> None:
    """Refuse (409) a config that would answer to one name twice (an alias that is its own name). Names
    other configs and adapters hold are refused by the store when the config is written."""
    clash = routing_names.name_clash([(name, data.served_model_name, data.aliases)])
    if clash:
        raise Conflict(clash, field="aliases")


def _save(db: Session, config: ModelConfig, clash: str) -> None:
    """Commit ``config`` (added to ``db``) with the names it answers to, or roll both back with a 409 that
    names who holds a name already (or ``clash``, for another constraint: its name, its profile)."""
    wanted = routing_names.names_of(config)
    try:
        db.flush()
        routing_names.hold_config_names(db, config)
        db.commit()
    except IntegrityError as exc:
        db.rollback()
        # Its own name held by another config is the name taken (``clash``), not a routing name.
        refusal = routing_names.taken(db, wanted, mine=[wanted[0][0]])
        raise (refusal or Conflict(clash)) from exc


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


# Raises Invalid, naming the nodes there are, for a node the Ray cluster does not have.
NodeCheck = Callable[[str], object]


def _fields(db: Session, data: ModelConfigIn, allow_code_flags: bool, stored: ModelConfig | None = None) -> dict:
    # A hidden value sent back as it was shown (a reader without the token, the edit page) stays as stored.
    extra_args, env = keep_stored(
        data.extra_args, data.env, stored.extra_args if stored else [], stored.env if stored else {}
    )
    check_launch_fields(extra_args, env, allow_code_flags)
    fields = {**data.model_dump(exclude={"offload_profile", "name"}), "extra_args": extra_args, "env": env}
    fields["offload_profile_id"] = profiles.get_profile(db, data.offload_profile).id if data.offload_profile else None
    return fields


def create_model(
    db: Session, data: ModelConfigCreate, *, rules: WriteRules = WriteRules(), check_node: NodeCheck | None = None
) -> ModelConfig:
    if data.node and check_node is not None:
        check_node(data.node)
    if rules.local_paths:
        check_path_exists(data.model)
    if db.exec(select(ModelConfig).where(ModelConfig.name == data.name)).first():
        raise Conflict(f"a model config named {data.name!r} already exists")
    check_own_names(data.name, data)
    config = ModelConfig(name=data.name, **_fields(db, data, rules.allow_code_flags))
    db.add(config)
    _save(db, config, f"a model config named {data.name!r} already exists")
    db.refresh(config)
    return config


def replace_model(
    db: Session,
    name: str,
    data: ModelConfigIn,
    *,
    rules: WriteRules = WriteRules(),
    check_node: NodeCheck | None = None,
) -> ModelConfig:
    config = get_model(db, name)
    if data.node and data.node != config.node and check_node is not None:
        check_node(data.node)
    if rules.local_paths and data.model != config.model:
        check_path_exists(data.model)
    check_own_names(name, data)
    for key, value in _fields(db, data, rules.allow_code_flags, stored=config).items():
        setattr(config, key, value)
    config.updated_at = utcnow()
    db.add(config)
    _save(db, config, f"model config {name!r} changed meanwhile (its offload profile was removed?); try again")
    db.refresh(config)
    return config


def delete_model(db: Session, name: str) -> None:
    from manager.schemas.worker import ENDED_STATES, Worker

    config = get_model(db, name)
    # A worker that holds (or will soon hold) an engine needs its config.
    busy = db.exec(select(Worker.id).where(Worker.model_name == name, col(Worker.state).not_in(ENDED_STATES))).all()
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
