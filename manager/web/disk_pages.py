"""The Models on disk page: what the hub caches hold, which model configs use each model, and deleting
one. Routes only translate: the list and the deletion are manager.hub.cache's, as for /api/cache, and a
refusal shows that library's message in the list."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse

from manager.deps import DownloadsDep, SessionDep, SettingsDep, SupervisorDep, is_authorized
from manager.errors import ManagerError
from manager.hub import cache as hub_cache
from manager.services import models
from manager.web.render import nbytes, render

router = APIRouter(include_in_schema=False)


def _caches(request: Request, db, settings) -> list[hub_cache.HubCache]:
    caches = hub_cache.list_caches(models.list_models(db))
    return caches if is_authorized(request, db, settings) else hub_cache.as_seen_without_token(caches)


def _list(request: Request, db, settings, message: str | None = None, error: str | None = None) -> str:
    return render("fragments/disk_list.html", caches=_caches(request, db, settings), message=message, error=error)


@router.get("/disk", response_class=HTMLResponse)
def disk_page(request: Request, db: SessionDep, settings: SettingsDep) -> HTMLResponse:
    return HTMLResponse(render("disk.html", page="disk", listing=_list(request, db, settings)))


@router.get("/ui/disk/list", response_class=HTMLResponse)
def disk_list(request: Request, db: SessionDep, settings: SettingsDep) -> HTMLResponse:
    return HTMLResponse(_list(request, db, settings))


@router.post("/ui/disk/delete", response_class=HTMLResponse)
def delete(
    request: Request,
    db: SessionDep,
    settings: SettingsDep,
    sup: SupervisorDep,
    downloads: DownloadsDep,
    repo: Annotated[str, Form(max_length=200)],
    cache: Annotated[str, Form(max_length=4096)] = "",
    revision: Annotated[str, Form(max_length=256)] = "",
) -> HTMLResponse:
    try:
        deleted = hub_cache.delete(
            repo,
            models.list_models(db),
            sup.views(),
            revision=revision or None,
            cache=cache or None,
            downloads=downloads.unfinished(),
        )
    except ManagerError as exc:
        return HTMLResponse(_list(request, db, settings, error=exc.message))
    what = f"revision {revision} of {deleted.repo}" if revision else deleted.repo
    message = f"Deleted {what} from {deleted.cache}: {nbytes(deleted.freed_bytes)} freed."
    return HTMLResponse(_list(request, db, settings, message=message))
