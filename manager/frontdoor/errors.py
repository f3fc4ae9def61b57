"""Errors the front door answers with, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every refusal says what was wrong and what to do; the route layer turns one into a JSON response
with its status and headers (Retry-After for a full queue, or a model being downloaded).
"""

from __future__ import annotations

import math
from typing import Any

from manager.hub.fetching import Progress


class FrontDoorError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(FrontDoorError):
    code = "invalid_request"


class ModelNotFound(FrontDoorError):
    status = 404
    code = "model_not_found"


class EndpointNotFound(FrontDoorError):
    status = 404
    code = "unknown_url"


class MethodNotAllowed(FrontDoorError):
    status = 405
    code = "method_not_allowed"

    def __init__(self, message: str, allowed: list[str]) -> None:
        super().__init__(message, headers={"Allow": ", ".join(allowed)})


class NoCredentials(FrontDoorError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class KeyExpired(NoCredentials):
    """A real key, past its expires_at."""


class NotAllowed(FrontDoorError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class TooLarge(FrontDoorError):
    status = 413
    code = "request_too_large"


class QueueFull(FrontDoorError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})
        self.retry_after_s = retry_after_s


class OverKeyLimit(FrontDoorError):
    """A request over one of its key's limits (requests or tokens per minute, in flight, its budget)."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, limit: str, headers: dict[str, str]) -> None:
        super().__init__(message, headers=headers)
        self.limit = limit
        # OpenAI's codes: a rate limit, or a quota (the budget) used up.
        self.code = "insufficient_quota" if limit == "budget" else "rate_limit_exceeded"


class TooManyWrongKeys(FrontDoorError):
    """Too many wrong keys or tokens from one address lately: it waits before the next, right or not."""

    status = 429
    type = "rate_limit_error"
    code = "too_many_wrong_keys"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})


class ModelUnavailable(FrontDoorError):
    """The model cannot be served now: it does not fit, its start failed, or busy workers did not drain."""

    status = 503
    type = "server_error"
    code = "model_unavailable"


class ModelDownloading(ModelUnavailable):
    """The model is being downloaded from the Hugging Face Hub; its engine starts once the download is
    complete. Retry-After says when to ask again: the time the download has left, within 1 .. 60 s."""

    code = "model_downloading"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, config: str, progress: Progress | None) -> ModelDownloading:
        eta = progress.eta_s if progress is not None else None
        retry = 10 if eta is None else max(1, min(60, math.ceil(eta)))
        return cls(progress.line(config) if progress is not None else f"downloading {config}", retry)


class LoadCancelled(ModelUnavailable):
    """A start or wake made for requests that have all gone (their clients left) was cancelled. A request
    that joined it as it was being cancelled starts the model again rather than hearing this."""

    code = "model_load_cancelled"


class StartTimeout(FrontDoorError):
    status = 504
    type = "server_error"
    code = "model_start_timeout"


class QueueTimeout(FrontDoorError):
    """The request waited for its turn at a busy model (its max_concurrent) longer than the queue timeout."""

    status = 504
    type = "server_error"
    code = "queue_timeout"


class EngineUnreachable(FrontDoorError):
    status = 502
    type = "server_error"
    code = "engine_unreachable"


class ClientLeft(FrontDoorError):
    """The client went away while its request waited for its model. Nobody reads the answer: the status
    (nginx's "client closed request") is for the metrics and the usage table alone."""

    status = 499
    type = "invalid_request_error"
    code = "client_left"
