"""The adapter registry: add (checked), list, remove, pin, and the load time of each adapter."""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from manager.errors import Conflict, NotFound
from manager.lora.checks import AdapterCheck, check_adapter
from manager.schemas.common import expand_home, utcnow
from manager.schemas.lora_adapter import LoraAdapter, LoraAdapterCreate, LoraAdapterPublic
from manager.services import models, routing_names


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
    held = routing_names.taken(db, [(data.name, "adapter")])
    if held is not None:  # said before its folder is read; the store still decides when two add at once
        raise held
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
    try:
        db.flush()
        routing_names.hold_adapter_name(db, adapter)
        db.commit()
    except IntegrityError as exc:
        db.rollback()
        refusal = routing_names.taken(db, [(data.name, "adapter")])
        if refusal is not None and refusal.detail.get("held_by") != data.name:
            raise refusal from exc
        raise Conflict(f"a LoRA adapter named {data.name!r} already exists") from exc
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
