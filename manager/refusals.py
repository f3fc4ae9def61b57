"""The two shapes an error answer takes: the manager's API answers in ``ErrorBody``'s shape, the front
door (/v1) in OpenAI's, which the official clients read. Below the routes, so that the middleware and
the front door's forwarder processes refuse in the same shapes as the app's error handlers."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from starlette.responses import JSONResponse

from manager.inference_endpoints import is_front_door
from manager.schemas.errors import ErrorBody, OpenAIError, OpenAIErrorDetail


def error_answer(status: int, body: ErrorBody, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error of the manager's API."""
    content = body.model_dump(mode="json", exclude={"errors"} if body.errors is None else None)
    return JSONResponse(content, status_code=status, headers=headers)


# Set on a request's scope when the middleware refuses it before any route runs (a host name this
# manager does not answer to, a body over its limit), so that the audit log, which names routes,
# records it too.
REFUSED_BEFORE_ROUTING = "vllm_manager.refused_before_routing"


def refused_before_routing(scope: MutableMapping[str, Any], status: int, message: str) -> JSONResponse:
    scope[REFUSED_BEFORE_ROUTING] = True
    return refusal(scope["path"], status, message)


def refusal(path: str, status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """A refusal made before any route runs (by the middleware, or the router for an unknown path or
    method), in the shape of the part of the API the path belongs to."""
    if is_front_door(path):
        detail = OpenAIErrorDetail(message=message, type="invalid_request_error", param=None, code=None)
        return JSONResponse(OpenAIError(error=detail).model_dump(), status_code=status, headers=headers)
    return error_answer(status, ErrorBody(detail=message), headers)
