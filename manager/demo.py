"""The first model a newcomer runs: a tiny model made on this machine and a config that fits anywhere.

Nothing is downloaded: the model has a real config and tokenizer and no weights, and vLLM serves it
with random ones (`--load-format dummy`). Its KV cache is held to 1 GiB, so the config starts on a
laptop's CPU as well as on a GPU: on vLLM's CPU backend a KV size given outright replaces
gpu_memory_utilization's share of host RAM, which a busy machine may not have free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlmodel import Session

from manager.errors import NotFound
from manager.schemas.model_config import ModelConfigCreate
from manager.settings import Settings

DEMO_CONFIG = "tiny"
KV_CACHE = "1G"


@dataclass(frozen=True)
class Demo:
    model_dir: Path
    made_model: bool
    added_config: bool


def demo_config(model_dir: Path) -> ModelConfigCreate:
    return ModelConfigCreate(
        name=DEMO_CONFIG,
        model=str(model_dir),
        max_model_len=2048,
        extra_args=["--load-format", "dummy", "--kv-cache-memory-bytes", KV_CACHE],
    )


def set_up(db: Session, settings: Settings) -> Demo:
    """Make the tiny model under the data folder (unless it is there) and add its config (unless a
    config of that name exists: edits made since are kept)."""
    from manager.services import models
    from manager.tiny_model import ensure_tiny_llama

    model_dir = settings.data_dir / "models" / "tiny-llama"
    made = ensure_tiny_llama(model_dir)
    try:
        models.get_model(db, DEMO_CONFIG)
    except NotFound:
        models.create_model(db, demo_config(model_dir), rules=models.WriteRules.of(settings))
        return Demo(model_dir, made, added_config=True)
    return Demo(model_dir, made, added_config=False)
