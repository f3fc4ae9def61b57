"""The front door: OpenAI-compatible endpoints where a request's model picks the worker. HTTP only.

Each route hands the request to ``FrontDoor``, which finds the model, gets a ready worker (starting
or swapping it in as needed) and streams the engine's answer back. Paths not listed here, the
engine's own control endpoints among them, answer 404: they are never forwarded.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from manager.deps import FrontDoorDep, InferenceCallerDep, InferenceRoute, require_inference_access
from manager.frontdoor.errors import EndpointNotFound

router = APIRouter(
    tags=["OpenAI-compatible (/v1)"],
    route_class=InferenceRoute,
    dependencies=[Depends(require_inference_access)],
)

# The engine endpoints a request may reach, each under its own path on the engine.
JSON_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
    "/v1/rerank",
    "/tokenize",
    "/detokenize",
)
MULTIPART_ENDPOINTS = ("/v1/audio/transcriptions",)


def _json_route(path: str):
    async def forward(request: Request, door: FrontDoorDep, caller: InferenceCallerDep) -> Response:
        return await door.forward_json(request, path, caller)

    forward.__name__ = "forward_" + path.strip("/").replace("/", "_")
    return forward


def _multipart_route(path: str):
    async def forward(request: Request, door: FrontDoorDep, caller: InferenceCallerDep) -> Response:
        return await door.forward_multipart(request, path, caller)

    forward.__name__ = "forward_" + path.strip("/").replace("/", "_")
    return forward


for _path in JSON_ENDPOINTS:
    router.add_api_route(_path, _json_route(_path), methods=["POST"], summary=f"Forwarded to the model's {_path}")
for _path in MULTIPART_ENDPOINTS:
    router.add_api_route(_path, _multipart_route(_path), methods=["POST"], summary=f"Forwarded to the model's {_path}")


@router.get("/v1/models")
def list_models(door: FrontDoorDep, caller: InferenceCallerDep) -> JSONResponse:
    """Every name the caller may use (config names, served names, aliases, LoRA adapters) with its state."""
    return JSONResponse(door.listing(caller))


@router.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
def not_forwarded(path: str) -> None:
    raise EndpointNotFound(
        f"/v1/{path} is not an endpoint of this server; it forwards "
        f"{', '.join(JSON_ENDPOINTS + MULTIPART_ENDPOINTS)} and lists models at GET /v1/models"
    )
