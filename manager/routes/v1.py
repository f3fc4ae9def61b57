"""The front door: OpenAI-compatible endpoints where a request's model picks the worker. HTTP only.

Each route hands the request to ``FrontDoor``, which finds the model, gets a ready worker (starting
or swapping it in as needed) and streams the engine's answer back. Paths not listed here, the
engine's own control endpoints among them, answer 404: they are never forwarded.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from manager.deps import (
    ForwardRoute,
    FrontDoorDep,
    InferenceCallerDep,
    InferenceRoute,
    require_inference_access,
    runtime_of,
)
from manager.frontdoor import progress
from manager.frontdoor.access import inference_caller
from manager.frontdoor.errors import EndpointNotFound, MethodNotAllowed
from manager.inference_endpoints import JSON_ENDPOINTS, MODELS, MULTIPART_ENDPOINTS
from manager.openapi import REASONS, SERVER_SENT_EVENT, openai_errors

router = APIRouter(
    tags=["OpenAI-compatible (/v1)"],
    route_class=InferenceRoute,
    dependencies=[Depends(require_inference_access)],
)

_MODEL = {"type": "string", "minLength": 1, "description": "A name GET /v1/models lists"}
JSON_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["model"],
                "properties": {"model": _MODEL},
                "additionalProperties": True,
                "description": "The request as the engine's endpoint takes it; the manager reads only model",
            }
        }
    },
}
MULTIPART_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["model", "file"],
                "properties": {"model": _MODEL, "file": {"type": "string", "format": "binary"}},
                "additionalProperties": True,
            }
        }
    },
}
# What the engine answers is passed on as it is: JSON, or server-sent events for a streamed request.
ENGINE_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The engine's answer",
        "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": SERVER_SENT_EVENT}},
    }
}
# Asked for per request (manager.frontdoor.progress); not sent on, the engine never sees it.
LOADING_PROGRESS = {
    "name": progress.HEADER,
    "in": "header",
    "required": False,
    "schema": {"type": "string", "enum": list(progress.TAKES)},
    "description": "1 or true: a streamed request that waits for its model's start, wake or download gets SSE "
    "comment lines with the progress (': loading NAME 42 %') until its first chunk; 0 or false: none, even where "
    "its model config's loading_progress is on. Without it: as the model config says. Any other value is refused "
    "with 400",
}
FORWARD_STATUSES = (400, 401, 403, 404, 413, 429, 502, 503, 504)
FORWARD_ERRORS = openai_errors(*FORWARD_STATUSES)
JSON_FORWARD_ERRORS = openai_errors(
    *FORWARD_STATUSES, _400=f"{REASONS[400]}, or {progress.HEADER} is not one of {', '.join(progress.TAKES)}"
)


def _json_route(path: str):
    async def forward(request: Request) -> Response:
        runtime = runtime_of(request)
        caller = inference_caller(request, runtime.front_door, runtime.settings, runtime.throttles)
        return await runtime.front_door.forward_json(request, path, caller)

    forward.__name__ = "forward_" + path.strip("/").replace("/", "_")
    return forward


def _multipart_route(path: str):
    async def forward(request: Request) -> Response:
        runtime = runtime_of(request)
        caller = inference_caller(request, runtime.front_door, runtime.settings, runtime.throttles)
        return await runtime.front_door.forward_multipart(request, path, caller)

    forward.__name__ = "forward_" + path.strip("/").replace("/", "_")
    return forward


for _paths, _make_route, _body, _headers, _errors in (
    (JSON_ENDPOINTS, _json_route, JSON_BODY, [LOADING_PROGRESS], JSON_FORWARD_ERRORS),
    (MULTIPART_ENDPOINTS, _multipart_route, MULTIPART_BODY, [], FORWARD_ERRORS),
):
    for _path in _paths:
        router.add_api_route(
            _path,
            _make_route(_path),
            methods=["POST"],
            summary=f"Forwarded to the model's {_path}",
            responses={**ENGINE_ANSWER, **_errors},
            openapi_extra={"requestBody": _body, **({"parameters": _headers} if _headers else {})},
            route_class_override=ForwardRoute,
        )


@router.get(MODELS, responses=openai_errors(400, 401, 429, 503))
def list_models(door: FrontDoorDep, caller: InferenceCallerDep) -> JSONResponse:
    """Every name the caller may use (config names, served names, aliases, LoRA adapters) with its state."""
    return JSONResponse(door.listing(caller))


ALLOWED = {**dict.fromkeys((*JSON_ENDPOINTS, *MULTIPART_ENDPOINTS), ["POST"]), MODELS: ["GET", "HEAD"]}


# What /v1 does not serve is said to anyone (the OpenAPI document says as much): a wrong method or
# path is a 405 or 404 before any question of credentials.
not_served = APIRouter(route_class=InferenceRoute, include_in_schema=False)


@not_served.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
def not_forwarded(path: str, request: Request) -> None:
    allowed = ALLOWED.get(f"/v1/{path}")
    if allowed is not None:
        raise MethodNotAllowed(f"/v1/{path} does not take {request.method}; it takes {', '.join(allowed)}", allowed)
    raise EndpointNotFound(
        f"/v1/{path} is not an endpoint of this server; it forwards "
        f"{', '.join(JSON_ENDPOINTS + MULTIPART_ENDPOINTS)} and lists models at GET /v1/models"
    )
