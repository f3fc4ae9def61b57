"""The Models on disk page: what the hub caches hold, which model configs use each model, deleting one,
and downloads from the Hugging Face Hub. Routes only translate: the list and the deletion are
manager.hub.cache's, as for /api/cache, the downloads manager.hub.downloads', as for /api/downloads, and
a refusal shows that library's message where the user acted. The downloads table then moves with the
SSE stream (``view=disk``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse

from manager.deps import DownloadsDep, SessionDep, SettingsDep, SupervisorDep, is_authorized
from manager.errors import ManagerError
from manager.hub import cache as hub_cache
from manager.schemas.download import DownloadRequest
from manager.services import models
from manager.web.forms import FORM_LEVEL, FormErrors, parse_form, refusal, validate
from manager.web.live_dep import LiveViewsDep
from manager.web.render import nbytes, render

router = APIRouter(include_in_schema=False)


def _caches(request: Request, db, settings) -> list[hub_cache.HubCache]:
    caches = hub_cache.list_caches(models.list_models(db))
    return caches if is_authorized(request, db, settings) else hub_cache.as_seen_without_token(caches)


def _list(request: Request, db, settings, message: str | None = None, error: str | None = None) -> str:
    return render("fragments/disk_list.html", caches=_caches(request, db, settings), message=message, error=error)


def _download_form(values: dict, errors: FormErrors, message: str | None = None) -> str:
    return render("fragments/download_form.html", values=values, errors=errors, message=message)


@router.get("/disk", response_class=HTMLResponse)
def disk_page(request: Request, db: SessionDep, settings: SettingsDep, views: LiveViewsDep) -> HTMLResponse:
    return HTMLResponse(
        render(
            "disk.html",
            page="disk",
            listing=_list(request, db, settings),
            download_form=_download_form({}, FormErrors()),
            downloads=views.downloads_table(),
        )
    )


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
        return HTMLResponse(_list(request, db, settings, error=refusal(exc)))
    what = f"revision {revision} of {deleted.repo}" if revision else deleted.repo
    message = f"Deleted {what} from {deleted.cache}: {nbytes(deleted.freed_bytes)} freed."
    return HTMLResponse(_list(request, db, settings, message=message))


@router.post("/ui/disk/downloads", response_class=HTMLResponse)
async def start_download(request: Request, downloads: DownloadsDep) -> HTMLResponse:
    """Start a download from the form: the form again, with what was started or why not (gated, no such
    repo, no room on the disk); the table below shows it from the stream."""
    form = {key: value for key, value in (await request.form()).items() if isinstance(value, str)}
    errors = FormErrors()
    data = validate(DownloadRequest, parse_form(form, DownloadRequest, errors), errors)
    if data is None:
        return HTMLResponse(_download_form(form, errors))
    try:
        row = await downloads.start(data.repo, data.revision)
    except ManagerError as exc:
        errors.add(FORM_LEVEL, exc.message, exc.status)
        return HTMLResponse(_download_form(form, errors))
    message = f"Download {row.id}: {row.repo} ({nbytes(row.total_bytes)}) into {row.cache_dir}, progress below."
    return HTMLResponse(_download_form({}, FormErrors(), message=message))
