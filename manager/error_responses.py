"""How an error becomes an answer: the manager's API answers in ``ErrorBody``'s shape, /v1 in OpenAI's.

Every path to an error goes through here: the library's ManagerError, a request that does not match
the schema (422), Starlette's own refusals (an unknown path, a method a path does not take, a body that
cannot be parsed) and the front door's errors.
"""

from __future__ import annotations

import http

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import Scope

from manager.errors import ManagerError
from manager.frontdoor.errors import FrontDoorError
from manager.refusals import error_answer, refusal
from manager.schemas.errors import ErrorBody, FieldError


def field_errors(exc: RequestValidationError) -> list[FieldError]:
    # Field, rule and message only: echoing the input back can fail (Infinity is not JSON) and would
    # repeat secrets such as environment values.
    return [FieldError(loc=list(e.get("loc", ())), msg=e.get("msg", ""), type=e.get("type", "")) for e in exc.errors()]


def summary(errors: list[FieldError]) -> str:
    """One line naming each field and what is wrong with it ("name: String should match pattern ...")."""
    parts = []
    for e in errors:
        where = ".".join(str(p) for p in e.loc[1:]) or (str(e.loc[0]) if e.loc else "")
        parts.append(f"{where}: {e.msg}" if where else e.msg)
    return "; ".join(parts) or "the request does not match the API schema"


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route takes at this request's path."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    if "GET" in methods:
        methods.add("HEAD")  # manager.middleware.HeadAsGet answers it
    return sorted(methods)


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = field_errors(exc)
        return error_answer(422, ErrorBody(detail=summary(errors), errors=errors))

    @app.exception_handler(ManagerError)
    async def _manager_error(_request: Request, exc: ManagerError) -> JSONResponse:
        return error_answer(exc.status, ErrorBody(detail=exc.message, **exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        detail = str(exc.detail)
        if exc.status_code == 404 and detail == http.HTTPStatus.NOT_FOUND.phrase:
            detail = f"{request.url.path} is not a path of this manager: /docs lists the API"
        elif exc.status_code == 405:
            methods = allowed_methods(app, request.scope)
            headers["Allow"] = ", ".join(methods)
            detail = f"{request.url.path} does not take {request.method}; it takes {', '.join(methods)}"
        return refusal(request.url.path, exc.status_code, detail, headers)

    @app.exception_handler(FrontDoorError)
    async def _front_door_error(_request: Request, exc: FrontDoorError) -> JSONResponse:
        # /v1 answers in OpenAI's error shape, which the official clients read.
        return JSONResponse(status_code=exc.status, content=exc.body(), headers=exc.headers)
