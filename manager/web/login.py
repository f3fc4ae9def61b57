"""The login page: the API token in, a session cookie out, so that a browser need not keep the token.

The cookie is HttpOnly (scripts cannot read it), SameSite=Strict (other sites' pages cannot send it)
and Secure when the page came over https. Its value names a session the manager keeps
(manager.auth.sessions), never the token; logging out ends that session on the manager, not only in
the browser. Wrong tokens count against the address, as wrong bearer tokens do.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlmodel import Session

from manager.audit import caller
from manager.auth import sessions
from manager.auth.throttle import WRONG
from manager.deps import (
    SESSION_COOKIE,
    LoginNeeded,
    OpenRoute,
    SessionDep,
    SettingsDep,
    ThrottlesDep,
    current_session,
)
from manager.request_checks import client_address, kind_of
from manager.schemas.common import utcnow
from manager.services import tokens
from manager.web.render import render

router = APIRouter(include_in_schema=False, route_class=OpenRoute)

MAX_NEXT_LENGTH = 2000


def safe_next(value: str | None) -> str:
    """Where to go after logging in: a path on this manager, never another site (no open redirect)."""
    if not value or len(value) > MAX_NEXT_LENGTH or not value.startswith("/") or value.startswith("//"):
        return "/"
    if "\\" in value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "/"  # browsers read /\host as //host; control characters would split the header
    parts = urlsplit(value)
    if parts.scheme or parts.netloc or parts.path in ("/login", "/logout"):
        return "/"
    return value


def _page(status: int = 200, headers: dict[str, str] | None = None, **context: Any) -> HTMLResponse:
    days = sessions.SESSION_LIFETIME.days
    return HTMLResponse(render("login.html", page="login", days=days, **context), status, headers=headers)


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, db: SessionDep, settings: SettingsDep, next: str | None = None) -> HTMLResponse:
    """The form; or, for a browser already logged in, until when and a way to log out."""
    if not tokens.auth_required(db, settings.env_token):
        return _page(state="open", next=safe_next(next))
    session = current_session(request, db, settings)
    if session is not None:
        until = sessions.ends_at(session).strftime("%Y-%m-%d %H:%M UTC")
        return _page(state="signed-in", next=safe_next(next), until=until)
    return _page(state="form", next=safe_next(next))


@router.post("/login", response_class=HTMLResponse)
async def log_in(request: Request, db: SessionDep, settings: SettingsDep, throttles: ThrottlesDep) -> Response:
    form = await request.form()
    token = str(form.get("token") or "").strip()
    next_path = safe_next(str(form.get("next") or ""))
    if not await run_in_threadpool(tokens.auth_required, db, settings.env_token):
        caller.anonymous(request.scope)
        return RedirectResponse(next_path, 303)  # nothing to log in to: every page is open
    address = client_address(request)
    kind = kind_of(token)
    throttle = throttles[kind]
    wait_s = throttle.retry_after(address)
    if wait_s is not None:
        message = f"Too many {WRONG[kind]} from {address}: try again in {wait_s} s."
        caller.failed(request.scope, message)
        return _page(429, {"Retry-After": str(wait_s)}, state="form", next=next_path, error=message)
    if not token:
        caller.failed(request.scope, "no token was entered")
        return _page(401, state="form", next=next_path, error="Enter the API token.")
    digest = await run_in_threadpool(tokens.digest_if_valid, db, token, settings.env_token)
    if digest is None:
        throttle.record_failure(address)
        caller.failed(request.scope, "the token entered is not a valid API token")
        return _page(401, state="form", next=next_path, error="That is not a valid API token.")
    user_agent = request.headers.get("user-agent", "")
    value = await run_in_threadpool(sessions.start, db, digest, address, user_agent, utcnow())
    await run_in_threadpool(_note_session, request, db, value, settings.env_token)
    response = RedirectResponse(next_path, 303)
    response.set_cookie(
        SESSION_COOKIE,
        value,
        max_age=int(sessions.SESSION_LIFETIME.total_seconds()),
        path="/",
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


@router.post("/logout")
def log_out(request: Request, db: SessionDep, settings: SettingsDep) -> Response:
    value = request.cookies.get(SESSION_COOKIE)
    if value:
        _note_session(request, db, value, settings.env_token)
        sessions.end(db, value)  # the cookie the browser deletes stops working everywhere else too
    response = RedirectResponse("/login", 303)
    response.delete_cookie(
        SESSION_COOKIE, path="/", secure=request.url.scheme == "https", httponly=True, samesite="strict"
    )
    return response


def _note_session(request: Request, db: Session, value: str, env_token: str | None) -> None:
    """The audit log names the session logging in or out (by its id, never its cookie)."""
    found = sessions.find(db, value, utcnow())
    if found is not None:
        caller.by_session(request.scope, db, found, env_token)


def to_login_page(_request: Request, exc: LoginNeeded) -> Response:
    """A page asked for without logging in: the login page, and back to it afterwards."""
    return RedirectResponse(f"/login?next={quote(exc.next_path, safe='/')}", 303)


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.exception_handler(LoginNeeded)(to_login_page)
