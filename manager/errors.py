"""Errors the library raises for things a user did; the web layer maps each to one HTTP status."""

from __future__ import annotations


class ManagerError(Exception):
    status = 400

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


class Unauthorized(ManagerError):
    status = 401


class Forbidden(ManagerError):
    status = 403


class UnsupportedMediaType(ManagerError):
    status = 415


class Unavailable(ManagerError):
    """The manager cannot do it now (its database is locked or cannot be written); nothing changed."""

    status = 503


class InsufficientStorage(ManagerError):
    """The disk holding the data dir is full; nothing was saved."""

    status = 507
