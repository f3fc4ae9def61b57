"""FastAPI dependencies: the manager's parts (from its Runtime), the database session, the token check."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Annotated, Any

import httpx
from fastapi import Depends, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from sqlmodel import Session
from starlette.responses import Response

from manager.audit import caller
from manager.auth import sessions
from manager.auth.throttle import WrongTokenThrottle
from manager.db import session as open_session
from manager.errors import Forbidden, Unauthorized
from manager.frontdoor.access import Caller, inference_caller
from manager.frontdoor.front_door import FrontDoor
from manager.frontdoor.usage import UsageRecorder
from manager.hub.downloads import Downloads
from manager.lora.pin_keeper import PinKeeper
from manager.metrics import MetricsCollector
from manager.request_checks import (
    SAFE_METHODS,
    bearer,
    kind_of,
    record_wrong_token,
    refuse_cross_site,
    refuse_while_throttled,
)
from manager.runtime import Runtime
from manager.schemas.browser_session import BrowserSession
from manager.schemas.common import utcnow
from manager.services import tokens
from manager.settings import Settings, is_loopback
from manager.supervisor.supervisor import Supervisor

# Integers in paths and query strings, bounded so that a number no table can hold is a 422 naming the
# parameter (SQLite's INTEGER is signed 64-bit) and the bounds show in the OpenAPI schema.
MAX_ROW_ID = 2**63 - 1
MAX_PID = 2**22  # Linux's PID_MAX_LIMIT
MAX_LOG_TAIL = 5000
MAX_EVENTS = 1000

WorkerId = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="The worker's id")]
Pid = Annotated[int, Path(ge=1, le=MAX_PID, description="Process id of a vLLM server the manager did not start")]
LogTail = Annotated[int, Query(ge=0, le=MAX_LOG_TAIL, description="How many of the last log lines to send")]


def runtime_of(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


# The getters below are coroutines so that FastAPI calls them on the event loop: as plain functions
# each would be a hop through its thread pool, for an attribute read.
async def get_runtime(request: Request) -> Runtime:
    return runtime_of(request)


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


async def get_settings(runtime: RuntimeDep) -> Settings:
    return runtime.settings


def get_db(runtime: RuntimeDep) -> Iterator[Session]:
    with open_session(runtime.engine) as db:
        yield db


async def get_supervisor(runtime: RuntimeDep) -> Supervisor:
    return runtime.supervisor


async def get_metrics(runtime: RuntimeDep) -> MetricsCollector:
    return runtime.metrics


async def get_pin_keeper(runtime: RuntimeDep) -> PinKeeper:
    return runtime.pin_keeper


async def get_engine_http(runtime: RuntimeDep) -> httpx.AsyncClient:
    return runtime.http


async def get_front_door(runtime: RuntimeDep) -> FrontDoor:
    return runtime.front_door


async def get_throttles(runtime: RuntimeDep) -> Mapping[str, WrongTokenThrottle]:
    return runtime.throttles


def get_usage_recorder(runtime: RuntimeDep) -> UsageRecorder:
    return runtime.usage


async def get_downloads(runtime: RuntimeDep) -> Downloads:
    return runtime.downloads


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_db)]
SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
MetricsDep = Annotated[MetricsCollector, Depends(get_metrics)]
PinKeeperDep = Annotated[PinKeeper, Depends(get_pin_keeper)]
EngineHttpDep = Annotated[httpx.AsyncClient, Depends(get_engine_http)]
FrontDoorDep = Annotated[FrontDoor, Depends(get_front_door)]
ThrottlesDep = Annotated[Mapping[str, WrongTokenThrottle], Depends(get_throttles)]
UsageRecorderDep = Annotated[UsageRecorder, Depends(get_usage_recorder)]
DownloadsDep = Annotated[Downloads, Depends(get_downloads)]


SESSION_COOKIE = "vllm_manager_session"


def current_session(request: Request, db: Session, settings: Settings) -> BrowserSession | None:
    """The live browser session the request's cookie stands for: not expired, not logged out or ended
    by the admin, and its token still valid (a session of a token gone is ended here)."""
    value = request.cookies.get(SESSION_COOKIE)
    if not value:
        return None
    found = sessions.find(db, value, utcnow())
    if found is None:
        return None
    if not tokens.digest_is_valid(db, found.token_sha256, settings.env_token):
        sessions.end(db, value)  # its token was revoked, or VLLM_MANAGER_API_TOKEN changed
        return None
    return found


def has_valid_session(request: Request, db: Session, settings: Settings) -> bool:
    """True when the request carries a session cookie from the login page that is still good."""
    return current_session(request, db, settings) is not None


def is_authorized(request: Request, db: Session, settings: Settings) -> bool:
    """True when no token is configured, or the request carries a valid one (or a session from the login page)."""
    if not tokens.auth_required(db, settings.env_token):
        return True
    token = bearer(request)
    if token is not None:
        return tokens.token_is_valid(db, token, settings.env_token)
    return has_valid_session(request, db, settings)


def refuse_unproven_origin(request: Request) -> None:
    """A write that a session cookie authorizes must show it comes from this manager's own pages.

    A browser sends the cookie with any request to this host, and some (older ones, form posts from
    plugins) send no Origin: without Origin or Sec-Fetch-Site the write cannot be told from another
    site's, so it is refused. Scripts send the token instead, and are not held to this.
    """
    if request.method in SAFE_METHODS or "origin" in request.headers:
        return  # an Origin header was checked by refuse_cross_site
    if request.headers.get("sec-fetch-site") == "same-origin":
        return
    raise Forbidden(
        "a change made with a login session must come from this manager's own pages: the request carries "
        "neither an Origin nor a Sec-Fetch-Site header (scripts send 'Authorization: Bearer <token>' instead)"
    )


class InferenceRoute(APIRoute):
    """A route that answers inference clients (the front door, /v1). The admin token rule below does
    not apply to it: ``require_inference_access`` does, as a dependency of its router."""


class ForwardRoute(InferenceRoute):
    """A /v1 route that forwards to an engine: its endpoint takes the request alone and checks access
    itself (``inference_caller``), so FastAPI solves no dependencies for it, which was a tenth of the
    manager's CPU per forwarded request (bench/README.md). Its documentation is the route as declared."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        # The dependencies such a route may be declared under: its endpoint does them itself (the admin
        # check returns at once for /v1). Another one would silently not run: refused at start.
        done_by_endpoint = (require_admin_access, require_inference_access)
        unknown = [
            getattr(d.dependency, "__name__", repr(d.dependency))
            for d in self.dependencies
            if d.dependency is not None and d.dependency not in done_by_endpoint
        ]
        if unknown:
            raise TypeError(f"{self.path} forwards without solving dependencies, so {unknown} would never run")
        endpoint: Callable[[Request], Coroutine[Any, Any, Response]] = self.endpoint
        return endpoint


class OpenRoute(APIRoute):
    """A route anyone may call, token or not: the health probe and the login page. Writes to it are
    still refused from other sites."""


class LoginNeeded(Exception):
    """A browser asked for a page without logging in: it is sent to the login page, and back to
    ``next_path`` afterwards."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


def wants_page(request: Request) -> bool:
    """A browser navigating to a page (not htmx swapping a fragment in, not a script or a stream)."""
    return (
        request.method == "GET"
        and "hx-request" not in request.headers
        and "text/html" in request.headers.get("accept", "")
    )


def has_credentials(request: Request, db: Session, settings: Settings) -> bool:
    """Whether the request carries a valid bearer token or a good session cookie.

    A bearer token is always checked: a wrong one is a 401 and counts against the request's address,
    and an address with too many wrong ones gets 429 until its window ends, right token or not. An
    inference key sent here counts against the keys' limit, not the admin token's."""
    token = bearer(request)
    if token is None:
        found = current_session(request, db, settings)
        if found is None:
            return False
        refuse_unproven_origin(request)
        caller.by_session(request.scope, db, found, settings.env_token)
        return True
    kind = kind_of(token)
    throttles = runtime_of(request).throttles
    refuse_while_throttled(request, kind, throttles)
    if tokens.token_is_valid(db, token, settings.env_token):
        caller.by_token(request.scope, db, token, settings.env_token)
        return True
    record_wrong_token(request, kind, throttles)
    raise Unauthorized("the bearer token is not valid")


async def require_admin_access(request: Request) -> None:
    """Once any token exists, every call needs it (a bearer token, or a session from the login page),
    except the open routes. With VLLM_MANAGER_OPEN_READS reads stay open and only changes need it."""
    if isinstance(request.scope.get("route"), InferenceRoute):
        return  # /v1 answers to require_inference_access, without opening a database session
    await run_in_threadpool(_check_admin_access, request)


def require_token(request: Request, db: SessionDep, settings: SettingsDep) -> None:
    """For reads that answer with secrets (the export): once any token exists, they need it even where
    reads are open (VLLM_MANAGER_OPEN_READS)."""
    if not is_authorized(request, db, settings):
        raise Unauthorized("this answer holds environment values: send 'Authorization: Bearer <token>'")


def needs_token(route: APIRoute, method: str, settings: Settings) -> bool:
    """Whether a call of the manager's API needs the token once one exists (the OpenAPI schema says so)."""
    if isinstance(route, OpenRoute):
        return False
    if not settings.open_reads:
        return True
    return method not in SAFE_METHODS or any(d.dependency is require_token for d in route.dependencies)


def inference_needs_credentials(settings: Settings, keys_exist: bool) -> bool:
    """Whether /v1 needs an inference key or the admin token (``manager.frontdoor.access``)."""
    return keys_exist or not (is_loopback(settings.host) or settings.open_inference)


def _check_admin_access(request: Request) -> None:
    runtime = runtime_of(request)
    settings = runtime.settings
    refuse_cross_site(request)
    if isinstance(request.scope.get("route"), OpenRoute):
        return
    with open_session(runtime.engine) as db:
        if not tokens.auth_required(db, settings.env_token):
            caller.anonymous(request.scope)
            return
        if has_credentials(request, db, settings):
            return
    if request.method not in SAFE_METHODS:
        raise Unauthorized(
            "this call changes state and needs 'Authorization: Bearer <token>' (or a session from /login)"
        )
    if settings.open_reads:
        return
    if wants_page(request):
        raise LoginNeeded(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
    raise Unauthorized(
        "this manager has an API token, so reading needs it too: send 'Authorization: Bearer <token>' "
        "or log in at /login (VLLM_MANAGER_OPEN_READS=1 opens reads)"
    )


async def require_inference_access(request: Request, door: FrontDoorDep, settings: SettingsDep) -> Caller:
    return inference_caller(request, door, settings, runtime_of(request).throttles)


InferenceCallerDep = Annotated[Caller, Depends(require_inference_access)]
