"""Model configs: create, read, replace, delete, with the offload profile named by its name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from sqlmodel import Session, col, select

from manager.db import commit_or_conflict
from manager.errors import Conflict, NotFound
from manager.launch.refusals import check_launch_fields
from manager.launch.secrets import keep_stored
from manager.lora.records import LoraAdapter
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

NAMES_RULE = (
    "the names /v1 requests use (config names, served model names, aliases, LoRA adapter names) must each "
    "lead to one model"
)


def routing_names(name: str, served_model_name: str | None, aliases: Sequence[str]) -> list[tuple[str, str]]:
    """The names a request's "model" can use for one config, each with what it is."""
    names = [(name, "name")]
    if served_model_name and served_model_name != name:
        names.append((served_model_name, "served model name"))
    return names + [(alias, "alias") for alias in aliases]


def name_clash(
    configs: Iterable[tuple[str, str | None, Sequence[str]]], adapters: Iterable[tuple[str, str]] = ()
) -> str | None:
    """The first name that two things would answer to, said as a refusal; None when all are unique.

    ``configs``: (name, served_model_name, aliases); ``adapters``: (adapter name, its base config).
    """
    owner: dict[str, str] = {}

    def claim(name: str, what: str) -> str | None:
        if name in owner:
            return f"{name!r} is both the {owner[name]} and the {what}; {NAMES_RULE}"
        owner[name] = what
        return None

    for config_name, served, aliases in configs:
        for name, kind in routing_names(config_name, served, aliases):
            clash = claim(name, f"{kind} of model config {config_name!r}")
            if clash:
                return clash
    for adapter, base in adapters:
        clash = claim(adapter, f"LoRA adapter of {base!r}")
        if clash:
            return clash
    return None


def check_names(db: Session, name: str, data: ModelConfigIn) -> None:
    """Refuse (409) a config whose name, served name or an alias already routes to something else."""
    others = [(m.name, m.served_model_name, m.aliases) for m in list_models(db) if m.name != name]
    adapters = [(a.name, a.base_config) for a in db.exec(select(LoraAdapter))]
    clash = name_clash([(name, data.served_model_name, data.aliases), *others], adapters)
    if clash:
        raise Conflict(clash, field="aliases")


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
    db: Session, data: ModelConfigCreate, *, allow_code_flags: bool = False, check_node: NodeCheck | None = None
) -> ModelConfig:
    if data.node and check_node is not None:
        check_node(data.node)
    if db.exec(select(ModelConfig).where(ModelConfig.name == data.name)).first():
        raise Conflict(f"a model config named {data.name!r} already exists")
    check_names(db, data.name, data)
    config = ModelConfig(name=data.name, **_fields(db, data, allow_code_flags))
    db.add(config)
    commit_or_conflict(db, f"a model config named {data.name!r} already exists")
    db.refresh(config)
    return config


def replace_model(
    db: Session,
    name: str,
    data: ModelConfigIn,
    *,
    allow_code_flags: bool = False,
    check_node: NodeCheck | None = None,
) -> ModelConfig:
    config = get_model(db, name)
    if data.node and data.node != config.node and check_node is not None:
        check_node(data.node)
    check_names(db, name, data)
    for key, value in _fields(db, data, allow_code_flags, stored=config).items():
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
