"""The engine endpoints the front door forwards, each to the same path on the engine."""

from __future__ import annotations

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
MODELS = "/v1/models"  # the listing of the names requests may use, answered by the manager itself


def is_front_door(path: str) -> bool:
    """Whether a path belongs to /v1 (and its errors take OpenAI's shape)."""
    return path.startswith("/v1/") or path in JSON_ENDPOINTS
