"""A model read from the Hugging Face Hub without downloading it: its config.json, the safetensors
headers of the weight files vLLM would load (HTTP range reads), and the list of files with their
sizes, which says what a download would take and whether the cache's disk has room."""

from __future__ import annotations

from collections.abc import Mapping

from manager.hub import client, files
from manager.hub.download_plan import plan_download
from manager.hub.model_location import engine_cache
from manager.planner.model_files import (
    ModelFiles,
    ModelNotFound,
    find_model_folder,
    in_hub_cache,
    is_hub_id,
    read_folder,
    sizes_from_headers,
)
from manager.planner.records import ModelSource


def read_from_hub(repo: str, revision: str | None = None, env: Mapping[str, str] | None = None) -> ModelFiles:
    env = dict(env or {})
    client.check_repo_id(repo, field="model")
    client.refuse_if_offline(repo, "plan")
    cache = engine_cache(env)
    plan = plan_download(repo, revision, env, cache)
    config = client.read_json(plan.listing, "config.json", env)
    shards = [f.path for f in plan.files if f.path.endswith(".safetensors")]
    headers = client.safetensors_headers(plan.listing, shards, env)
    weights = sizes_from_headers([headers[name] for name in shards]) if shards else None
    source = ModelSource(
        kind="hub",
        repo=repo,
        commit=plan.listing.commit,
        hub=client.endpoint(),
        download_bytes=plan.total_bytes,
        needed_bytes=plan.needed_bytes,
        cache_dir=str(cache),
        free_bytes=plan.free_bytes,
        fits_on_disk=plan.fits,
    )
    return ModelFiles(None, config, weights, source)


def read_model(model: str, env: Mapping[str, str] | None = None) -> ModelFiles:
    """The model's config and weight sizes: from a local folder, a snapshot in the Hugging Face cache, or
    (for a hub id in neither, or a download cut short) the hub itself, by its config.json and safetensors
    headers alone. ``env``: the environment of the engine it is read for (its HF_TOKEN reads a gated
    model, its cache is the one whose disk a download would fill)."""
    try:
        folder = find_model_folder(model)
    except ModelNotFound:
        if not is_hub_id(model):
            raise
        return read_from_hub(model, env=env)
    if in_hub_cache(folder) and files.missing(folder):
        return read_from_hub(model, env=env)
    return read_folder(folder)
