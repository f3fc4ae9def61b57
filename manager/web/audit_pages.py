"""The Audit page: who changed what, from where, and what came of it, newest first, with filters.

It reads what /api/audit reads (manager.audit.store), and like it needs the admin token (or a login
session) even where reads are open: it says who changed what.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse

from manager.audit import store
from manager.deps import LoginNeeded, SessionDep, SettingsDep, is_authorized, wants_page
from manager.errors import ManagerError, Unauthorized
from manager.web.render import render

RANGES = {"1h": "last hour", "24h": "last 24 hours", "7d": "last 7 days", "30d": "last 30 days", "all": "all kept"}
RANGE_DELTAS = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7), "30d": timedelta(days=30)}
OUTCOMES = {"": "any", "ok": "ok", "failed": "failed"}
PAGE_ROWS = 200


def require_login(request: Request, db: SessionDep, settings: SettingsDep) -> None:
    if is_authorized(request, db, settings):
        return
    if wants_page(request):
        raise LoginNeeded(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
    raise Unauthorized("the audit log needs 'Authorization: Bearer <token>' or a session from /login")


router = APIRouter(include_in_schema=False, dependencies=[Depends(require_login)])


def _chosen(request: Request) -> dict[str, str]:
    asked = request.query_params
    period, outcome = asked.get("range") or "", asked.get("outcome") or ""
    return {
        "range": period if period in RANGES else "7d",
        "who": (asked.get("who") or "").strip()[:256],
        "action": (asked.get("action") or "").strip()[:256],
        "outcome": outcome if outcome in OUTCOMES else "",
    }


def _rows(db, chosen: dict[str, str]) -> dict[str, Any]:
    delta = RANGE_DELTAS.get(chosen["range"])
    filters = store.Filters(
        since=datetime.now(UTC) - delta if delta else None,
        who=chosen["who"] or None,
        action=chosen["action"] or None,
        outcome=chosen["outcome"] or None,
        limit=PAGE_ROWS,
    )
    try:
        return {"audit": store.find(db, filters), "error": None}
    except ManagerError as exc:
        return {"audit": None, "error": exc.message}


@router.get("/audit", response_class=HTMLResponse)
def audit_page(request: Request, db: SessionDep) -> HTMLResponse:
    chosen = _chosen(request)
    context = {"chosen": chosen, "ranges": RANGES, "outcomes": OUTCOMES, **_rows(db, chosen)}
    return HTMLResponse(render("audit.html", page="audit", **context))


@router.get("/ui/audit/list", response_class=HTMLResponse)
def audit_list(request: Request, db: SessionDep) -> HTMLResponse:
    return HTMLResponse(render("fragments/audit_list.html", **_rows(db, _chosen(request))))
