"""The models in the Hugging Face hub caches on this machine, and deleting them. HTTP only: manager.hub.cache."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from manager.deps import DownloadsDep, SessionDep, SettingsDep, SupervisorDep, is_authorized
from manager.hub import cache as hub_cache
from manager.hub.cache import REPO_PART, Deleted, HubCache
from manager.openapi import errors
from manager.services import models

router = APIRouter(prefix="/api/cache", tags=["hub cache"])

Owner = Annotated[str, Path(pattern=f"^{REPO_PART}$", description="The owner in the model's Hugging Face id")]
Name = Annotated[str, Path(pattern=f"^{REPO_PART}$", description="The name in the model's Hugging Face id")]
Revision = Annotated[
    str | None,
    Query(min_length=1, max_length=256, description="Delete only this revision: a commit, or a ref such as main"),
]
Cache = Annotated[
    str | None,
    Query(min_length=1, max_length=4096, description="The cache folder, when the model is in more than one"),
]


@router.get("", response_model=list[HubCache])
def list_cache(request: Request, db: SessionDep, settings: SettingsDep) -> list[HubCache]:
    """Each hub cache the manager or a model config reads, with its models, their revisions (complete or
    not) and the model configs that use them."""
    caches = hub_cache.list_caches(models.list_models(db))
    return caches if is_authorized(request, db, settings) else hub_cache.as_seen_without_token(caches)


@router.delete(
    "/{owner}/{name}",
    response_model=Deleted,
    responses=errors(
        404,
        409,
        422,
        _404="The model (or that revision of it) is not in the cache, or no model config uses a cache there",
        _409="A worker whose model config uses the model is active, a download into it runs (the message names "
        "it), or the model links to files outside the cache",
        _422="The model is in more than one cache and the call does not say which",
    ),
)
def delete_cached(
    owner: Owner,
    name: Name,
    db: SessionDep,
    sup: SupervisorDep,
    downloads: DownloadsDep,
    revision: Revision = None,
    cache: Cache = None,
) -> Deleted:
    """Delete a model from the hub cache, all its revisions or one; refused while a worker uses it or a
    download into it runs."""
    return hub_cache.delete(
        f"{owner}/{name}",
        models.list_models(db),
        sup.views(),
        revision=revision,
        cache=cache,
        downloads=downloads.unfinished(),
    )
