"""FastAPI dependencies: the manager's parts (from its Runtime), the database session, the token check."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated
from urllib.parse import urlsplit

import httpx
from fastapi import Depends, Path, Query, Request
from fastapi.routing import APIRoute
from sqlmodel import Session

from manager.db import session as open_session
from manager.errors import Forbidden, ManagerError, Unauthorized
from manager.frontdoor.access import Caller, caller_for
from manager.frontdoor.errors import NotAllowed
from manager.frontdoor.front_door import FrontDoor
from manager.frontdoor.usage import UsageRecorder
from manager.lora.pin_keeper import PinKeeper
from manager.metrics import MetricsCollector
from manager.runtime import Runtime
from manager.services import tokens
from manager.settings import Settings
from manager.supervisor.supervisor import Supervisor
from manager.web.live import LiveViews

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}

# Integers in paths and query strings, bounded so that a number no table can hold is a 422 naming the
# parameter (SQLite's INTEGER is signed 64-bit) and the bounds show in the OpenAPI schema.
MAX_ROW_ID = 2**63 - 1
MAX_PID = 2**22  # Linux's PID_MAX_LIMIT
MAX_LOG_TAIL = 5000
MAX_EVENTS = 1000

WorkerId = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="The worker's id")]
Pid = Annotated[int, Path(ge=1, le=MAX_PID, description="Process id of a vLLM server the manager did not start")]
LogTail = Annotated[int, Query(ge=0, le=MAX_LOG_TAIL, description="How many of the last log lines to send")]


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_settings(runtime: RuntimeDep) -> Settings:
    return runtime.settings


def get_db(runtime: RuntimeDep) -> Iterator[Session]:
    with open_session(runtime.engine) as db:
        yield db


def get_supervisor(runtime: RuntimeDep) -> Supervisor:
    return runtime.supervisor


def get_metrics(runtime: RuntimeDep) -> MetricsCollector:
    return runtime.metrics


def get_live_views(runtime: RuntimeDep) -> LiveViews:
    return runtime.live_views


def get_pin_keeper(runtime: RuntimeDep) -> PinKeeper:
    return runtime.pin_keeper


def get_engine_http(runtime: RuntimeDep) -> httpx.AsyncClient:
    return runtime.http


def get_front_door(runtime: RuntimeDep) -> FrontDoor:
    return runtime.front_door


def get_usage_recorder(runtime: RuntimeDep) -> UsageRecorder:
    return runtime.usage


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_db)]
SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
MetricsDep = Annotated[MetricsCollector, Depends(get_metrics)]
LiveViewsDep = Annotated[LiveViews, Depends(get_live_views)]
PinKeeperDep = Annotated[PinKeeper, Depends(get_pin_keeper)]
EngineHttpDep = Annotated[httpx.AsyncClient, Depends(get_engine_http)]
FrontDoorDep = Annotated[FrontDoor, Depends(get_front_door)]
UsageRecorderDep = Annotated[UsageRecorder, Depends(get_usage_recorder)]


def _bearer(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def is_authorized(request: Request, db: Session, settings: Settings) -> bool:
    """True when no token is configured, or the request carries a valid one."""
    if not tokens.auth_required(db, settings.env_token):
        return True
    token = _bearer(request)
    return token is not None and tokens.token_is_valid(db, token, settings.env_token)


def refuse_cross_site(request: Request) -> None:
    """A page on another site must not make the user's browser change anything here (CSRF).

    Browsers send Origin (and Sec-Fetch-Site) with cross-origin writes; scripts and the CLI send neither.
    """
    if request.method in SAFE_METHODS:
        return
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise Forbidden("cross-site request refused")
    origin = request.headers.get("origin")
    if origin and origin != "null" and urlsplit(origin).netloc != request.headers.get("host", ""):
        raise Forbidden(f"request from another origin ({origin}) refused")
    if origin == "null":
        raise Forbidden("request from an opaque origin refused")


class InferenceRoute(APIRoute):
    """A route that answers inference clients (the front door, /v1). The admin token rule below does
    not apply to it: ``require_inference_access`` does, as a dependency of its router."""


def require_token_for_changes(request: Request, db: SessionDep, settings: SettingsDep) -> None:
    """Once any token exists, every call that changes something must carry one."""
    if isinstance(request.scope.get("route"), InferenceRoute):
        return
    refuse_cross_site(request)
    if request.method in SAFE_METHODS:
        return
    if not tokens.auth_required(db, settings.env_token):
        return
    token = _bearer(request)
    if token is None:
        raise Unauthorized("this call changes state and needs 'Authorization: Bearer <token>'")
    if not tokens.token_is_valid(db, token, settings.env_token):
        raise Unauthorized("the bearer token is not valid")


def require_inference_access(request: Request, db: SessionDep, settings: SettingsDep) -> Caller:
    """Who may send requests to /v1 (``manager.frontdoor.access``): an inference key once any exists,
    else anyone on a loopback bind, and on a public bind the admin token unless /v1 was opened
    explicitly. Browsers on other sites are refused as for every other call: they must not make a
    visitor's machine run models.
    """
    try:
        refuse_cross_site(request)
    except ManagerError as exc:
        raise NotAllowed(exc.message) from None
    return caller_for(db, _bearer(request), settings)


InferenceCallerDep = Annotated[Caller, Depends(require_inference_access)]
