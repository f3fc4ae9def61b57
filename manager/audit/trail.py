"""The audit trail: every change asked of the manager over HTTP (a write to any of its routes but /v1's:
the API, the dashboard's forms, logging in and out) leaves one row, written after it is answered.

Plain ASGI middleware around the host and body-size checks (they refuse before any route runs; such a
refusal is recorded with the path asked for), inside which routing finds the matched route's template
and path parameters, the token check who asked (``caller``), and the answer its status, refusals and
validation errors included. Writing the row happens off the event loop; a row that
cannot be written is logged, and the request it records is answered all the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
from sqlalchemy.engine import Engine
from starlette.datastructures import Headers
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from manager.audit import changes, store
from manager.audit import request as read
from manager.audit.caller import NOTE, Note
from manager.db import session
from manager.refusals import REFUSED_BEFORE_ROUTING
from manager.schemas.audit import MAX_FIELDS, AuditEntry

log = logging.getLogger("vllm_manager.audit")

RECORDED_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MAX_ERROR_BODY = 64 * 1024  # an error answer is read this far for its message


class AuditTrail:
    """The store written to is the app's runtime's (opened at start). ``skip``: routes that are not admin
    changes (/v1's), and ``skip_path``: their paths, told before routing so that a /v1 request costs
    nothing here; ``max_body``: the most of a body that is read for its field names (the largest body
    the app takes)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        skip: tuple[type[BaseRoute], ...] = (),
        skip_path: Callable[[str], bool] = lambda _path: False,
        max_body: int = 16 << 20,
    ) -> None:
        self.app = app
        self.skip = skip
        self.skip_path = skip_path
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in RECORDED_METHODS or self.skip_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        note = scope[NOTE] = Note()
        body = bytearray()
        answer: dict[str, Any] = {"status": 500, "type": "", "body": bytearray()}

        async def reading() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(body) <= self.max_body:
                body.extend(message.get("body", b""))
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["type"] = Headers(raw=message.get("headers", [])).get("content-type", "")
            elif (
                message["type"] == "http.response.body"
                and answer["status"] >= 400
                and len(answer["body"]) < MAX_ERROR_BODY
            ):
                answer["body"].extend(message.get("body", b""))
            await send(message)

        watching = changes.CURRENT.set(note)
        try:
            await self.app(scope, reading, sending)
        except Exception as exc:
            answer["status"] = 500
            note.message = note.message or f"the manager failed: {type(exc).__name__}"
            raise
        finally:
            changes.CURRENT.reset(watching)
            route = scope.get("route")
            if (
                route is not None
                and not isinstance(route, self.skip)
                and scope["method"] in getattr(route, "methods", ())
            ) or (route is None and scope.get(REFUSED_BEFORE_ROUTING)):
                headers = Headers(scope=scope)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(
                        self._write, scope, route, note, bytes(body), headers.get("content-type", ""), answer
                    )

    def _write(
        self, scope: Scope, route: BaseRoute | None, note: Note, body: bytes, content_type: str, answer: dict[str, Any]
    ) -> None:
        try:
            entry = entry_for(scope, route, note, body, content_type, answer, complete=len(body) <= self.max_body)
            engine: Engine = scope["app"].state.runtime.engine
            with session(engine) as db:
                store.add(db, entry)
        except Exception:
            log.exception("the audit row of %s %s could not be written", scope["method"], scope["path"])


def entry_for(
    scope: Scope,
    route: BaseRoute | None,
    note: Note,
    body: bytes,
    content_type: str,
    answer: dict[str, Any],
    complete: bool,
) -> AuditEntry:
    """The row of one request; ``route`` None: refused before routing, named by the path asked for."""
    if route is None:
        template, action = read.path_asked(scope["path"]), read.REFUSED_BEFORE_ROUTING
    else:
        template = str(getattr(route, "path_format", None) or getattr(route, "path", None) or scope["path"])
        action = read.action_of(scope["method"], template)
    data = read.parse_body(body, content_type) if complete and route is not None else None
    status = int(answer["status"])
    if status < 400 and note.refused_status is not None:
        status = note.refused_status
    message = note.message
    if status >= 400 and message is None:
        message = read.error_message(bytes(answer["body"]), answer["type"])
    if message is not None:
        secrets = set(read.secrets_in(data))
        if not complete:  # the values are not all known: keep what the message says before any quote
            message = message.split("'")[0].split('"')[0]
        message = read.scrub(message, secrets)
    client = scope.get("client")
    return AuditEntry(
        who=note.who,
        token=note.token,
        token_name=note.token_name,
        address=client[0] if client else "unknown",
        method=scope["method"],
        route=template,
        action=action,
        target=read.target_of(dict(scope.get("path_params") or {}), data),
        fields=read.fields_of(data),
        changed=sorted(note.changed)[:MAX_FIELDS],
        status=status,
        message=message,
    )
