"""The OpenAPI schema at /openapi.json, made to say what the API does.

Routes declare the errors of their own (``errors(404, 409)``: a name that is not stored, a name that is
taken). What every call of a kind can meet comes from the guards around the routes and is added here:
a Host name this manager does not answer to, a body that cannot be parsed or is too large, a token
that is missing, a request from another site, a database that is busy or a disk that is full. Every
error of the manager's API has one shape (``ErrorBody``); /v1 answers in OpenAI's (``OpenAIError``).

Which calls need the bearer token depends on whether one exists, which can change while the manager
runs (``vllm-manager token create``): each request for the schema says how it is now.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from pydantic.json_schema import models_json_schema

from manager.db import session
from manager.deps import InferenceRoute, inference_needs_credentials, needs_token
from manager.request_checks import SAFE_METHODS
from manager.schemas.errors import ErrorBody, OpenAIError
from manager.schemas.transfer import ExportFile
from manager.services import inference_keys, tokens
from manager.settings import Settings

REASONS = {
    400: "The request cannot be read: a Host name this manager does not answer to, or a body that is not "
    "valid JSON (or form data)",
    401: "The call needs 'Authorization: Bearer <token>' (once a token exists) and has none, or a wrong one",
    403: "Refused: a browser sent it from another site, or sent a change made with a login session without "
    "saying where it comes from (Origin)",
    404: "Nothing stored under that name or id",
    405: "The path does not take this method (the Allow header lists those it takes)",
    409: "Conflicts with what is stored or running now (a name taken, a worker in the way); the message says "
    "what to change",
    413: "The request body is larger than the manager takes here",
    415: "The body is not of a media type this call takes",
    422: "The request does not match this schema, or asks for something that cannot be done (a refused flag, "
    "a model that does not fit)",
    429: "Too many requests wait for this model; try again after Retry-After seconds",
    502: "The engine did not answer",
    503: "Cannot be done now: the database is busy or cannot be written, or the model cannot be served",
    504: "The model did not start in time",
    507: "The disk holding the manager's data is full; nothing was saved",
}

BEARER = HTTPBearer(
    scheme_name="bearer",
    auto_error=False,
    description="An admin token (`vllm-manager token create`, or VLLM_MANAGER_API_TOKEN). Once one exists, "
    "every call that changes something, and the export, need it; this schema lists it on those calls while "
    "one exists.",
)


# One message of a stream, as an EventSource sees it: its name, its data (JSON or HTML text) and, on the
# first, how soon to reconnect.
SERVER_SENT_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0},
    },
}
EVENT_STREAM: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-sent events until the client disconnects",
        "content": {"text/event-stream": {"schema": SERVER_SENT_EVENT}},
    }
}


def errors(*statuses: int, **reasons: str) -> dict[int | str, dict[str, Any]]:
    """Error responses for a route's ``responses=``, in the manager's shape. A reason given as
    ``_404="no such worker"`` replaces the general one."""
    return {s: {"model": ErrorBody, "description": reasons.get(f"_{s}", REASONS[s])} for s in statuses}


def openai_errors(*statuses: int, **reasons: str) -> dict[int | str, dict[str, Any]]:
    """Error responses for /v1 routes, in OpenAI's shape; ``_400="..."`` replaces the general reason, as in
    ``errors``."""
    declared: dict[int | str, dict[str, Any]] = {
        s: {"model": OpenAIError, "description": reasons.get(f"_{s}", REASONS[s])} for s in statuses
    }
    retry_after = {"description": "Seconds to wait before trying again", "schema": {"type": "integer"}}
    if 429 in declared:
        declared[429]["headers"] = {"Retry-After": retry_after}
    if 503 in declared:
        declared[503] = {
            **declared[503],
            "description": REASONS[503] + "; while the model is being downloaded from the Hugging Face Hub, the "
            "message says how far the download is and Retry-After when to ask again",
            "headers": {"Retry-After": {**retry_after, "description": "Sent while the model is being downloaded"}},
        }
    return declared


def _ref(model: type) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}


def _operations(app: FastAPI) -> list[tuple[APIRoute, str]]:
    return [
        (route, method)
        for route in app.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in sorted(route.methods)
    ]


def _guards(route: APIRoute, method: str, operation: dict[str, Any], settings: Settings) -> list[int]:
    """The statuses the guards around a manager route can answer it with (middleware and the token check:
    401 without it, 429 after too many wrong ones)."""
    statuses = [400, 503]
    if "requestBody" in operation:
        statuses.append(413)
    if needs_token(route, method, settings):
        statuses += [401, 429]
    if method not in SAFE_METHODS:
        statuses += [403, 507]
    return statuses


def describe(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """FastAPI's schema with every error declared in its shape and the bearer scheme named."""
    schema = copy.deepcopy(FastAPI.openapi(app))
    components = schema.setdefault("components", {})
    found = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        found.pop(name, None)
    _, top = models_json_schema(
        [(ErrorBody, "serialization"), (OpenAIError, "serialization"), (ExportFile, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    for name, definition in top.get("$defs", {}).items():
        found.setdefault(name, definition)  # FastAPI's own, where a route uses the model too
    components["securitySchemes"] = {
        BEARER.scheme_name: BEARER.model.model_dump(mode="json", by_alias=True, exclude_none=True)
    }
    for route, method in _operations(app):
        operation = schema["paths"][route.path_format][method.lower()]
        responses = operation.setdefault("responses", {})
        for response in responses.values():
            for media in response.get("content", {}).values():
                if "$ref" in media.get("schema", {}):  # a declared schema replaces FastAPI's {"type": "string"}
                    media["schema"] = {"$ref": media["schema"]["$ref"]}
        if isinstance(route, InferenceRoute):
            continue  # v1.py declares each of its errors, in OpenAI's shape
        if "422" in responses:  # FastAPI's own validation answer, which the manager answers in ErrorBody's shape
            responses["422"] = {"description": REASONS[422], "content": _ref(ErrorBody)}
        for status in _guards(route, method, operation, settings):
            responses.setdefault(str(status), {"description": REASONS[status], "content": _ref(ErrorBody)})
    return schema


def with_security(app: FastAPI, settings: Settings, schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the bearer token on each call that needs it now."""
    runtime = getattr(app.state, "runtime", None)
    if runtime is None:  # asked for outside a running manager (no store open): the token from the settings
        exist, keys = bool(settings.env_token), False
    else:
        with session(runtime.engine) as db:
            exist = tokens.auth_required(db, settings.env_token)
            keys = inference_keys.needs_key(db)
    described = copy.deepcopy(schema)
    for route, method in _operations(app):
        operation = described["paths"][route.path_format][method.lower()]
        if isinstance(route, InferenceRoute):
            required = inference_needs_credentials(settings, keys)
        else:
            required = exist and needs_token(route, method, settings)
        if required:
            operation["security"] = [{BEARER.scheme_name: []}]
    return described


def install(app: FastAPI, settings: Settings) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe(app, settings)
        return with_security(app, settings, app.openapi_schema)

    app.openapi = openapi  # type: ignore[method-assign]
