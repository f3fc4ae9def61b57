"""The names /v1 requests route by: which names a model config or LoRA adapter answers to, writing them
beside it, and the refusal that says who holds a name already.

The store's UNIQUE routing name decides between two clients that claim one name at once: a config or an
adapter and its names are written in one transaction, and a name held by another fails that transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlmodel import Session, col, delete, select

from manager.errors import Conflict
from manager.schemas.lora_adapter import LoraAdapter
from manager.schemas.model_config import ModelConfig
from manager.schemas.routing_name import RoutingName

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


def name_clash(configs: Iterable[tuple[str, str | None, Sequence[str]]]) -> str | None:
    """The first name that two of these configs (name, served_model_name, aliases) would answer to, said
    as a refusal; None when all are unique. For the names of one request (a config, an import file)
    before they meet those the store holds."""
    owner: dict[str, str] = {}
    for config_name, served, aliases in configs:
        for name, kind in routing_names(config_name, served, aliases):
            what = f"{kind} of model config {config_name!r}"
            if name in owner:
                return f"{name!r} is both the {owner[name]} and the {what}; {NAMES_RULE}"
            owner[name] = what
    return None


# The field of a request that gave each kind of name.
_FIELDS = {"name": "name", "served model name": "served_model_name", "alias": "aliases", "adapter": "name"}


def names_of(config: ModelConfig) -> list[tuple[str, str]]:
    return routing_names(config.name, config.served_model_name, config.aliases)


def release_config_names(db: Session, config: ModelConfig) -> None:
    """Let go of the names ``config`` holds, in the caller's transaction."""
    db.exec(delete(RoutingName).where(col(RoutingName.model_config_id) == config.id))


def hold_config_names(db: Session, config: ModelConfig) -> None:
    """Write the names ``config`` answers to now in place of those it held, in the caller's transaction
    (``config`` flushed: it has its id). IntegrityError when another config or an adapter holds one."""
    release_config_names(db, config)
    db.add_all(RoutingName(name=name, kind=kind, model_config_id=config.id) for name, kind in names_of(config))
    db.flush()


def hold_adapter_name(db: Session, adapter: LoraAdapter) -> None:
    """Write the adapter's name, in the caller's transaction (``adapter`` flushed). IntegrityError when
    a config or another adapter holds it."""
    db.add(RoutingName(name=adapter.name, kind="adapter", lora_adapter_id=adapter.id))
    db.flush()


def taken(db: Session, wanted: Iterable[tuple[str, str]], mine: Iterable[str] = ()) -> Conflict | None:
    """The refusal for the first of ``wanted`` that a config or adapter other than ``mine`` (config names)
    holds in the store now; None when none is held by another."""
    own = set(mine)
    for name, kind in wanted:
        row = db.exec(select(RoutingName).where(RoutingName.name == name)).first()
        if row is None:
            continue
        if row.model_config_id is not None:
            config = db.get(ModelConfig, row.model_config_id)
            if config is None or config.name in own:
                continue
            who, holder = f"the {row.kind} of model config {config.name!r}", config.name
        else:
            adapter = db.get(LoraAdapter, row.lora_adapter_id)
            if adapter is None:
                continue
            who, holder = f"a LoRA adapter of model config {adapter.base_config!r}", adapter.name
        return Conflict(f"{name!r} is {who}; {NAMES_RULE}", field=_FIELDS[kind], name=name, held_by=holder)
    return None
