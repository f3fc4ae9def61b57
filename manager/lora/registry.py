"""The adapter registry: add (checked), list, remove, pin, and the load time of each adapter."""

from __future__ import annotations

from sqlmodel import Session, select

from manager.db import commit_or_conflict
from manager.errors import Conflict, NotFound
from manager.lora.checks import AdapterCheck, check_adapter
from manager.lora.records import LoraAdapter, LoraAdapterCreate, LoraAdapterPublic
from manager.schemas.common import expand_home, utcnow
from manager.services import models


def list_adapters(db: Session, base_config: str | None = None) -> list[LoraAdapter]:
    query = select(LoraAdapter).order_by(LoraAdapter.name)
    if base_config is not None:
        query = query.where(LoraAdapter.base_config == base_config)
    return list(db.exec(query))


def get_adapter(db: Session, name: str) -> LoraAdapter:
    adapter = db.exec(select(LoraAdapter).where(LoraAdapter.name == name)).first()
    if adapter is None:
        raise NotFound(f"no LoRA adapter named {name!r}; `vllm-manager loras list` shows them")
    return adapter


def add_adapter(db: Session, data: LoraAdapterCreate) -> tuple[LoraAdapter, AdapterCheck]:
    """Store an adapter after checking it against its model config (Invalid if it cannot serve)."""
    if db.exec(select(LoraAdapter).where(LoraAdapter.name == data.name)).first():
        raise Conflict(f"a LoRA adapter named {data.name!r} already exists")
    config = models.get_model(db, data.base_config)
    if data.name == config.name or data.name == (config.served_model_name or ""):
        raise Conflict(
            f"{data.name!r} is the base model's own name; requests could not tell "
            f"the adapter from the model: choose another name"
        )
    for other in models.list_models(db):
        for name, kind in models.routing_names(other.name, other.served_model_name, other.aliases):
            if name == data.name:
                raise Conflict(f"{name!r} is the {kind} of model config {other.name!r}; {models.NAMES_RULE}")
    check = check_adapter(data.path, config)
    # Engines run in their own folder: keep the absolute path the manager checked.
    adapter = LoraAdapter(
        name=data.name,
        path=str(expand_home(data.path).resolve()),
        base_config=data.base_config,
        rank=check.rank,
        pinned=data.pinned,
    )
    db.add(adapter)
    commit_or_conflict(db, f"a LoRA adapter named {data.name!r} already exists")
    db.refresh(adapter)
    return adapter, check


def remove_adapter(db: Session, name: str) -> None:
    db.delete(get_adapter(db, name))
    db.commit()


def set_pinned(db: Session, name: str, pinned: bool) -> LoraAdapter:
    adapter = get_adapter(db, name)
    adapter.pinned = pinned
    db.add(adapter)
    db.commit()
    db.refresh(adapter)
    return adapter


def record_load(db: Session, name: str, seconds: float) -> None:
    adapter = db.exec(select(LoraAdapter).where(LoraAdapter.name == name)).first()
    if adapter is None:  # removed from the registry while it loaded
        return
    adapter.last_load_s = seconds
    adapter.last_loaded_at = utcnow()
    db.add(adapter)
    db.commit()


def to_public(adapter: LoraAdapter) -> LoraAdapterPublic:
    return LoraAdapterPublic.model_validate(adapter.model_dump())
