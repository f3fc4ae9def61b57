"""Finding a model's config.json and weight sizes, never downloading its weights.

A model is a local folder, a hub id (``org/name``) in the local Hugging Face cache (``HF_HUB_CACHE``,
else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), or a hub id read from the hub itself
(manager.hub.source). Weight sizes come from the safetensors headers: the 8-byte length and the JSON
header at the start of each file, so a 60 GB model is sized by reading a few kilobytes (on the hub,
with HTTP range requests).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manager.planner.records import ModelSource
from manager.schemas.common import expand_home

# Tensor names of routed experts (Qwen-MoE, Mixtral, DeepSeek, gpt-oss); shared experts stay dense.
_EXPERT_NAME = re.compile(r"\.experts\.|\.block_sparse_moe\.experts\.|\.mlp\.experts\b")
_SHARED_EXPERT = re.compile(r"shared_expert")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the header


class ModelNotFound(FileNotFoundError):
    """Neither a local folder nor a model in the local Hugging Face cache."""


@dataclass(frozen=True)
class WeightFiles:
    """Sizes read from the safetensors headers of one model."""

    total_bytes: int
    expert_bytes: int  # routed experts only
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    files: int = 0

    @property
    def dense_bytes(self) -> int:
        return self.total_bytes - self.expert_bytes


@dataclass(frozen=True)
class ModelFiles:
    folder: Path | None  # None: read from the hub, not on disk
    config: dict[str, Any]
    weights: WeightFiles | None  # None when the model has no safetensors files
    source: ModelSource


# Reads a model's files by its name: ``read_model`` (this machine), or the hub's, which also asks the hub.
ModelReader = Callable[[str], ModelFiles]


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache of a process with ``env`` (default: this one's)."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def cached_snapshot(model_id: str, cache: Path | None = None) -> Path | None:
    """The snapshot folder of ``model_id`` in the hub cache (``cache``, else this process's), or None."""
    repo = (cache or hub_cache_dir()) / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = snapshots / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    # No main ref (a pinned revision was fetched): the newest snapshot with a config.
    candidates = [p for p in snapshots.iterdir() if (p / "config.json").is_file()]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def find_model_folder(model: str) -> Path:
    """The folder holding ``model``'s config.json: a local path or a snapshot in the HF cache."""
    try:
        path = expand_home(model)
    except ValueError as exc:
        raise ModelNotFound(f"model {model!r} {exc}") from exc
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json; point the planner at the model's folder.")
        return path
    if "/" in model and not model.startswith(("/", ".", "~")):
        snap = cached_snapshot(model)
        if snap is not None:
            return snap
    raise ModelNotFound(
        f"model {model!r} is neither a local folder nor in the Hugging Face cache at {hub_cache_dir()}: give the "
        "model folder's path (the one holding config.json), or a Hugging Face id such as Qwen/Qwen3-0.6B"
    )


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file, without reading any tensor data."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER:
            raise ValueError(f"{path}: header of {length} bytes; not a safetensors file")
        return json.loads(f.read(length))


def is_expert_tensor(name: str) -> bool:
    return bool(_EXPERT_NAME.search(name)) and not _SHARED_EXPERT.search(name)


def weight_files(folder: Path) -> WeightFiles | None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    return sizes_from_headers([read_safetensors_header(path) for path in files])


def sizes_from_headers(headers: list[dict[str, Any]]) -> WeightFiles:
    """Weight sizes from safetensors headers, wherever they were read (a folder, or the hub by range reads)."""
    total = experts = 0
    by_dtype: dict[str, int] = {}
    for header in headers:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            size = int(end) - int(start)
            total += size
            by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + size
            if is_expert_tensor(name):
                experts += size
    return WeightFiles(total, experts, by_dtype, len(headers))


def read_model(model: str) -> ModelFiles:
    """The model's config and weight sizes from a local folder or a snapshot in the Hugging Face cache:
    this machine alone (``manager.hub.source.read_model`` also reads the hub)."""
    return read_folder(find_model_folder(model))


def in_hub_cache(folder: Path) -> bool:
    """Whether ``folder`` is a snapshot in a Hugging Face cache (not a model folder of the user's own)."""
    return folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--")


def read_folder(folder: Path) -> ModelFiles:
    """The config and weight sizes of the model in ``folder``."""
    in_cache = in_hub_cache(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
    source = ModelSource(kind="cache" if in_cache else "folder", cache_dir=str(folder) if in_cache else None)
    return ModelFiles(folder, config, weight_files(folder), source)


def is_hub_id(model: str) -> bool:
    return model.count("/") == 1 and not model.startswith(("/", ".", "~"))
