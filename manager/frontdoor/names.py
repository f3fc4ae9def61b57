"""Which model config (and LoRA adapter) a request's "model" names, and what GET /v1/models lists.

Pure: the callers pass the stored configs, the registered adapters and the workers' views.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State

ModelState = Literal["ready", "sleeping", "starting", "downloading", "stopped"]
# A config with several workers (one running, older stopped ones) shows its best state.
_RANK: dict[ModelState, int] = {"ready": 4, "sleeping": 3, "starting": 2, "downloading": 1, "stopped": 0}


@dataclass(frozen=True)
class ConfigNames:
    """The names one model config answers to."""

    config: str
    served_model_name: str | None = None
    aliases: Sequence[str] = ()
    created: int = 0  # unix seconds, for the listing

    @property
    def served(self) -> str:
        """The name the engine serves the model under (vLLM's --served-model-name)."""
        return self.served_model_name or self.config


@dataclass(frozen=True)
class AdapterNames:
    name: str
    base_config: str
    created: int = 0


@dataclass(frozen=True)
class Target:
    """Where a request goes: the config whose worker serves it, and the model name the engine knows."""

    config: str
    upstream_model: str  # the config's served name, or the adapter's name (vLLM serves adapters by name)
    adapter: str | None = None
    kind: Literal["name", "served model name", "alias", "adapter"] = "name"


class UnknownModel(LookupError):
    def __init__(self, requested: str, known: Sequence[str]) -> None:
        self.requested = requested
        self.known = list(known)
        listed = ", ".join(self.known) if self.known else "none: create a model config first"
        super().__init__(f"The model {requested!r} does not exist. Models that exist: {listed}")


class NameTable:
    """Every name a request may use, each leading to one target.

    The store holds each name once (``manager.schemas.routing_name``). One pair can remain from a store
    written before it did: a LoRA adapter named like a config's name or alias, which routes nowhere
    (configs are added first, and the first target of a name keeps it).
    """

    def __init__(self, configs: Iterable[ConfigNames], adapters: Iterable[AdapterNames] = ()) -> None:
        self.configs = sorted(configs, key=lambda c: c.config)
        self.adapters = sorted((a for a in adapters), key=lambda a: a.name)
        by_config = {c.config: c for c in self.configs}
        self._targets: dict[str, Target] = {}
        for c in self.configs:
            self._add(c.config, Target(c.config, c.served, kind="name"))
            self._add(c.served, Target(c.config, c.served, kind="served model name"))
            for alias in c.aliases:
                self._add(alias, Target(c.config, c.served, kind="alias"))
        for a in self.adapters:
            if a.base_config in by_config:  # an adapter whose config was deleted routes nowhere
                self._add(a.name, Target(a.base_config, a.name, adapter=a.name, kind="adapter"))

    def _add(self, name: str, target: Target) -> None:
        self._targets.setdefault(name, target)

    def resolve(self, requested: str) -> Target:
        target = self._targets.get(requested)
        if target is None:
            raise UnknownModel(requested, self.names())
        return target

    def only(self, configs: Collection[str]) -> NameTable:
        """The names of these configs and of their adapters only: for a caller limited to them, the
        others do not exist (the same 404, the same listing, as for a name nobody has)."""
        return NameTable(
            (c for c in self.configs if c.config in configs), (a for a in self.adapters if a.base_config in configs)
        )

    def names(self) -> list[str]:
        return sorted(self._targets)

    def items(self) -> list[tuple[str, Target]]:
        return sorted(self._targets.items())


def state_of(config: str, views: Iterable[WorkerView]) -> ModelState:
    """The model's state from its workers' views: ready, sleeping, starting, downloading or stopped."""
    best: ModelState = "stopped"
    for view in views:
        if view.model != config:
            continue
        state = _public_state(view.state)
        if _RANK[state] > _RANK[best]:
            best = state
    return best


def _public_state(state: State) -> ModelState:
    if state == State.READY:
        return "ready"
    if state == State.SLEEPING:
        return "sleeping"
    if state in (State.STARTING, State.WAKING):
        return "starting"
    if state == State.DOWNLOADING:
        return "downloading"
    # Stopping, failed and crashed workers serve nothing: a request would start the model again.
    return "stopped"


def listing(table: NameTable, views: Sequence[WorkerView]) -> dict[str, Any]:
    """GET /v1/models: every name a request may use, with the state of the model behind it.

    OpenAI's fields (id, object, created, owned_by), then ours: the model config behind the name,
    what kind of name it is, and its state; adapters also carry vLLM's ``parent`` (the base model).
    """
    created = {c.config: c.created for c in table.configs}
    created.update({a.name: a.created for a in table.adapters})
    states = {c.config: state_of(c.config, views) for c in table.configs}
    data = []
    for name, target in table.items():
        entry: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": created.get(target.adapter or target.config, 0),
            "owned_by": "vllm-manager",
            "config": target.config,
            "kind": target.kind,
            "state": states[target.config],
        }
        if target.adapter:
            entry["parent"] = next(c.served for c in table.configs if c.config == target.config)
        data.append(entry)
    return {"object": "list", "data": data}
