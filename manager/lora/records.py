"""An adapter as a worker serves it (the stored adapter is ``manager.schemas.lora_adapter``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter a worker serves now, as its /v1/models lists it."""

    name: str
    path: str  # vLLM's "root"
    base_model: str  # vLLM's "parent"
