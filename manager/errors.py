"""Errors the library raises for things a user did; the web layer maps each to one HTTP status."""

from __future__ import annotations


class ManagerError(Exception):
    status = 400
    headers: dict[str, str] | None = None  # HTTP headers the answer carries

    def __init__(self, message: str, **detail):
        super().__init__(message)
        self.message = message
        self.detail = detail


class NotFound(ManagerError):
    status = 404


class Conflict(ManagerError):
    status = 409


class Invalid(ManagerError):
    """Input that is well-formed but not acceptable (a refused flag, vLLM rejecting the argv, ...)."""

    status = 422


class WaitsForNodes(Invalid):
    """A start the cluster's live nodes cannot hold until a lost node is back: a model spanning nodes
    with too few GPUs left, or a config naming a lost node."""


class Unauthorized(ManagerError):
    status = 401
    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(ManagerError):
    status = 403


class TooManyAttempts(ManagerError):
    """Too many wrong tokens from one address: it waits ``retry_after_s`` seconds before the next."""

    status = 429

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, retry_after_s=retry_after_s)
        self.headers = {"Retry-After": str(retry_after_s)}


class UnsupportedMediaType(ManagerError):
    status = 415


class Unavailable(ManagerError):
    """The manager cannot do it now (its database is locked or cannot be written); nothing changed."""

    status = 503


class InsufficientStorage(ManagerError):
    """The disk holding the data dir is full; nothing was saved."""

    status = 507
