"""Where a config's model is on this machine: a local folder that must be there, or a hub id that is in
the local Hugging Face cache or that vLLM downloads during its start.

A path that does not exist is refused when the config is written (vLLM would take it for a hub id and
fail half a minute later with Hugging Face's "Repo id must be in the form ..."). A hub id that is not in
the cache is said so before the start: its download counts against the start's timeout.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from manager.errors import Invalid
from manager.hub import files
from manager.planner import model_files

_TRUE = {"1", "true", "yes", "on"}


def is_local_path(model: str) -> bool:
    # Stored configs hold local paths absolute (the schema resolves ./ ../ ~); hub ids never start with '/'.
    return model.startswith("/")


def check_path_exists(model: str, *, where: str = "model") -> None:
    """Invalid (422) for a model that names a local path this machine does not have."""
    if is_local_path(model) and not Path(model).exists():
        raise Invalid(
            f"{where}: {model} does not exist on this machine. Give the model's folder (the one holding "
            "config.json), or a Hugging Face id such as Qwen/Qwen3-0.6B",
            field=where,
        )


def engine_cache(config_env: Mapping[str, str]) -> Path:
    """The hub cache an engine started with ``config_env`` reads (its environment is this process's
    with the config's env over it)."""
    return model_files.hub_cache_dir({**os.environ, **config_env})


def not_cached(model: str, config_env: Mapping[str, str]) -> Path | None:
    """The cache folder ``model`` is missing from, for a hub id vLLM would download; None for a local
    path or a hub id whose snapshot in the cache holds everything a start reads. A snapshot with the
    config alone (the planner fetches that much) is not enough: the weights would still be downloaded."""
    if is_local_path(model):
        return None
    cache = engine_cache(config_env)
    snapshot = model_files.cached_snapshot(model, cache)
    if snapshot is not None and not files.missing(snapshot):
        return None
    return cache


def download_note(model: str, config_env: Mapping[str, str]) -> str | None:
    """What a start of a hub id not in the cache does, for previews and the start's event."""
    cache = not_cached(model, config_env)
    if cache is None:
        return None
    return (
        f"{model} is not in this machine's Hugging Face cache ({cache}): vLLM downloads it during the start, "
        "and the download counts against the start timeout"
    )


def check_startable(model: str, config_env: Mapping[str, str]) -> None:
    """Before a start: Invalid for a local path that is gone, or for a hub id not in the cache when the
    engine may not download (HF_HUB_OFFLINE)."""
    check_path_exists(model)
    if downloads_forbidden(config_env):
        cache = not_cached(model, config_env)
        if cache is not None:
            where = "the config's env" if downloads_forbidden_by(config_env) else "the manager's environment"
            raise Invalid(
                f"{model} is not in the Hugging Face cache at {cache} and HF_HUB_OFFLINE is set in {where}, so "
                "nothing may download it: unset it, download the model first, or give the model's local folder",
                field="model",
            )


def downloads_forbidden(config_env: Mapping[str, str]) -> bool:
    """Whether HF_HUB_OFFLINE is set for the engine (in its config's env, or the manager's it inherits)."""
    return downloads_forbidden_by({**os.environ, **config_env})


def downloads_forbidden_by(env: Mapping[str, str]) -> bool:
    """Whether ``env`` itself sets HF_HUB_OFFLINE."""
    return env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
