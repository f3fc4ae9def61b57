"""The Keys page (inference keys for /v1: make one, see it once, revoke) and the Usage page.

Routes only translate: they call the functions /api/keys and /api/usage call, so the pages show
the API's own messages.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from manager.deps import SessionDep, UsageRecorderDep
from manager.errors import ManagerError
from manager.schemas.inference_key import LIMIT_FIELDS, InferenceKeyCreate
from manager.services import inference_keys, models, usage
from manager.web.forms import FORM_LEVEL, FormErrors, refusal, validate
from manager.web.render import render

router = APIRouter(include_in_schema=False)

CHANGED = {"HX-Trigger": "keys-changed"}
# The page that shows a key must not be kept by the browser or anything between.
NOT_KEPT = {"Cache-Control": "no-store"}
RANGES = {"1h": "last hour", "6h": "last 6 hours", "24h": "last 24 hours", "7d": "last 7 days", "30d": "last 30 days"}
RANGE_DELTAS = {"1h": {"hours": 1}, "6h": {"hours": 6}, "24h": {"days": 1}, "7d": {"days": 7}, "30d": {"days": 30}}


def _page(template: str, **context: Any) -> HTMLResponse:
    return HTMLResponse(render(template, **context))


# ---- Keys ---------------------------------------------------------------------------------------


@router.get("/keys", response_class=HTMLResponse)
def keys_page() -> HTMLResponse:
    return _page("keys.html", page="keys")


def _form(db, values: dict, errors: FormErrors, created=None) -> HTMLResponse:
    html = render(
        "fragments/key_form.html",
        values=values,
        errors=errors,
        form_errors=errors.get(FORM_LEVEL),
        configs=[m.name for m in models.list_models(db)],
        created=created,
    )
    return HTMLResponse(html, headers={**NOT_KEPT, **(CHANGED if created else {})})


@router.get("/ui/keys/form", response_class=HTMLResponse)
def key_form(db: SessionDep) -> HTMLResponse:
    return _form(db, {}, FormErrors())


@router.post("/ui/keys", response_class=HTMLResponse)
async def create_key(request: Request, db: SessionDep) -> HTMLResponse:
    form = await request.form()
    values: dict[str, Any] = {
        "name": str(form.get("name") or "").strip(),
        "models": [str(m) for m in form.getlist("models")],
    }
    # An empty limit is no limit: left out, as the API takes it.
    for field in LIMIT_FIELDS:
        given = str(form.get(field) or "").strip()
        if given:
            values[field] = given
    errors = FormErrors()
    data = validate(InferenceKeyCreate, values, errors)
    if data is None:
        return _form(db, values, errors)
    try:
        created = inference_keys.create_key(db, data)
    except ManagerError as exc:
        db.rollback()
        errors.add(str(exc.detail.get("field", "name")), exc.message, exc.status)
        return _form(db, values, errors)
    return _form(db, {}, FormErrors(), created)


def _list(db, message: str | None = None, error: str | None = None) -> HTMLResponse:
    keys = [inference_keys.to_public(k) for k in inference_keys.list_keys(db)]
    access = inference_keys.access_now(db)
    # Every key revoked: /v1 stays closed until the admin opens it (or makes a key).
    can_open = access.needs_key and not any(k.active for k in keys)
    return _page("fragments/key_list.html", keys=keys, access=access, can_open=can_open, message=message, error=error)


@router.get("/ui/keys/list", response_class=HTMLResponse)
def key_list(db: SessionDep) -> HTMLResponse:
    return _list(db)


@router.post("/ui/keys/{name}/revoke", response_class=HTMLResponse)
def revoke_key(name: str, db: SessionDep) -> HTMLResponse:
    try:
        inference_keys.revoke_key(db, name)
    except ManagerError as exc:
        return _list(db, error=refusal(exc))
    return _list(db, f"Revoked {name}: /v1 refuses it from now on. Its usage stays on the Usage page.")


@router.post("/ui/keys/open-v1", response_class=HTMLResponse)
def open_v1(db: SessionDep) -> HTMLResponse:
    try:
        inference_keys.open_without_keys(db)
    except ManagerError as exc:
        return _list(db, error=refusal(exc))
    return _list(db, "/v1 is open without a key again, as before any key was made.")


# ---- Usage --------------------------------------------------------------------------------------


@router.get("/usage", response_class=HTMLResponse)
async def usage_page(request: Request, db: SessionDep, recorder: UsageRecorderDep) -> HTMLResponse:
    asked = request.query_params
    chosen = {
        "range": _choice(asked.get("range"), RANGES, "24h"),
        "per": _choice(asked.get("per"), usage.BUCKET_S, "hour"),
        "model": asked.get("model") or "",
        "key": asked.get("key") or "",
    }
    await recorder.flush()
    now = datetime.now(UTC)
    report, error = None, None
    try:
        report = usage.report(
            db,
            since=now - timedelta(**RANGE_DELTAS[chosen["range"]]),
            until=now,
            per=chosen["per"],
            model=chosen["model"] or None,
            key=chosen["key"] or None,
        )
    except ManagerError as exc:
        error = exc.message
    return _page(
        "usage.html",
        page="usage",
        report=report,
        error=error,
        chosen=chosen,
        ranges=RANGES,
        configs=[m.name for m in models.list_models(db)],
        key_names=sorted({k.name for k in inference_keys.list_keys(db)}),
    )


def _choice(value: str | None, allowed: Collection[str], default: str) -> str:
    return value if value is not None and value in allowed else default
