"""Loading progress for a streamed request that waits for its model (a start, a wake, a download).

Asked for per request (the ``X-Loading-Progress: 1`` header, or ``true``; ``0`` or ``false`` turns it off
for a config that has it on; any other value is refused) or per model config (``loading_progress``), and
only for a request that streams (``"stream": true``).
Once such a request has waited ``FIRST_AFTER_S`` for its model, its answer begins: status 200 with the
event-stream headers, then a comment line (``: loading qwen3-30b 42 %``) at once and every ``EVERY_S``
while it waits. OpenAI's clients skip comment lines; a proxy between them sees bytes flow and does not
time the request out; a person reading the raw stream sees what it waits for. The engine's events follow
as they come. What goes wrong once the answer has begun (the start failed, the engine refused the
request) can no longer be a status: it is one error event in OpenAI's shape,
``data: {"error": {"message", "type", "param", "code"}}``, which OpenAI's clients raise as an APIError.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from manager.frontdoor.errors import BadRequest

HEADER = "X-Loading-Progress"
# A request served at once (its model ready) is answered exactly as without progress: the stream of
# comments begins only once it has waited this long.
FIRST_AFTER_S = 1.0
EVERY_S = 3.0  # a comment line this often while it waits: well within a proxy's read timeout (nginx: 60 s)
ON = ("1", "true")
OFF = ("0", "false")
TAKES = (*ON, *OFF)  # the values the OpenAPI document declares, exactly: a value it lacks is refused
SHOWN_VALUE_LIMIT = 100  # characters of a refused value quoted back
ERROR_BODY_LIMIT = 64 * 1024  # of an engine's refusal, what is read to pass on in the error event


def asked(request: Request) -> bool | None:
    """What the request's header says: True (on), False (off), None (left out: its model config says).
    BadRequest for any other value, sent twice included (HTTP reads that as the two joined by a comma)."""
    values = request.headers.getlist(HEADER)
    if not values:
        return None
    value = ", ".join(values)
    if value not in TAKES:
        shown = value if len(value) <= SHOWN_VALUE_LIMIT else value[:SHOWN_VALUE_LIMIT] + "..."
        raise BadRequest(
            f"{HEADER}: {shown!r} is not a value it takes; send 1 or true for loading progress on a streamed "
            "request that waits for its model, 0 or false for none, or leave the header out for what the "
            "model config says",
            param=HEADER,
        )
    return value in ON


def wanted(payload: Mapping[str, Any], said: bool | None, config_on: bool) -> bool:
    """Whether this request gets loading progress: it streams, and its header (``said``: what ``asked``
    read) or, without one, its model config asks for it."""
    return payload.get("stream") is True and (config_on if said is None else said)


def comment(text: str) -> bytes:
    one_line = " ".join(text.split())  # a line break would end the comment
    return f": {one_line}\n\n".encode()


def error_event(body: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def engine_error(status: int, raw: bytes) -> dict[str, Any]:
    """An engine's refusal (its status and body) as an error event's body in OpenAI's shape."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return {"error": body["error"]}
    message = body.get("message") if isinstance(body, dict) else None  # vLLM's older shape
    if not isinstance(message, str):
        message = raw[:500].decode(errors="replace") or f"the engine answered {status}"
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": str(status)}}


async def comments(waiting: asyncio.Future[Any], loading: Callable[[], Awaitable[str]]) -> AsyncIterator[bytes]:
    """A comment line saying what ``waiting`` waits for, at once and every EVERY_S until it is done."""
    while not waiting.done():
        yield comment(await loading())
        await asyncio.wait({waiting}, timeout=EVERY_S)


class LoadingStream(StreamingResponse):
    """A 200 event stream begun before its model was ready; ``on_close`` runs once it has ended or the
    client left (shielded: after a disconnect this runs inside a cancelled scope)."""

    def __init__(
        self, body: AsyncIterator[bytes], on_close: Callable[[], None], headers: Mapping[str, str] | None
    ) -> None:
        # Not held back by a buffering proxy (nginx reads X-Accel-Buffering), so its readers see the lines.
        shown = {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        super().__init__(body, status_code=200, headers=shown, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                self._on_close()
