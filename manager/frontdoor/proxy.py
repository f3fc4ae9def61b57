"""Forwarding one request to its engine: the body read within a limit, the model named, the answer
passed back as it arrives.

Responses stream through chunk by chunk (as they arrive), never buffered beyond the event being
written, so Server-Sent Events reach the client as vLLM writes them (``metering`` reads their usage
on the way). When the client goes away, the upstream response is closed,
which makes vLLM abort the request; either way the request's lease on the worker ends with its
response. Only the endpoints the routes name are forwarded: the engine's own control endpoints
(/sleep, /wake_up, /collective_rpc, the LoRA loaders, ...) are never reachable from here.

``AddedTime`` measures what the manager adds to a request, with two clock reads at each end and
nothing per chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from manager.frontdoor.errors import BadRequest, ClientLeft, EngineUnreachable, TooLarge
from manager.frontdoor.upstream import EngineAnswer, Upstream, UpstreamError
from manager.launch.engine_key import bearer

# Client headers the engine may see: the body's type, what the client accepts, its request id. Never
# the client's Authorization (the manager's token is not the engine's business): an engine with an
# API key gets its own key from the manager.
FORWARD_HEADERS = ("content-type", "accept", "x-request-id")
# Engine headers the client sees; length and framing are the manager's own (it streams).
RETURN_HEADERS = ("content-type", "content-encoding", "x-request-id", "cache-control")

T = TypeVar("T")


@dataclass
class AddedTime:
    """The manager's own time in one request (``time.perf_counter`` seconds): from the route to the
    moment the request is handed to the engine, less the time it waited for its model (a start, a
    swap, a drain, an adapter load: the queue wait metric has that)."""

    arrived: float = field(default_factory=time.perf_counter)
    waited: float = 0.0
    sent: float | None = None

    def before_engine(self) -> float | None:
        return None if self.sent is None else max(0.0, self.sent - self.arrived - self.waited)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to be over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(_too_large(int(declared), limit))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(_too_large(size, limit, at_least=True))
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, at_least: bool = False) -> str:
    more = "at least " if at_least else ""
    return f"the request body is {more}{size} bytes; the limit is {limit} bytes (VLLM_MANAGER_PROXY_MAX_BODY_BYTES)"


# Python's JSON reader and writer recurse once per level of nesting and give up near a thousand levels.
TOO_DEEP = (
    "the request body is nested too deeply to read (arrays or objects inside each other hundreds of levels deep); "
    "send the request with its fields as the endpoint takes them"
)


def json_model(body: bytes) -> tuple[dict[str, Any], str]:
    """The JSON object of a request and the model it names (400 when either is missing)."""
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    if not isinstance(payload, dict):
        raise BadRequest("the request body must be a JSON object")
    return payload, _model_field(payload.get("model"))


def _model_field(model: Any) -> str:
    if model is None or model == "":
        raise BadRequest(
            'the request names no model: set "model" to one of the names GET /v1/models lists', param="model"
        )
    if not isinstance(model, str):
        raise BadRequest('"model" must be a string (a name GET /v1/models lists)', param="model")
    return model


def with_changes(payload: dict[str, Any], body: bytes, changes: Mapping[str, Any]) -> bytes:
    """The body to forward: as sent, unless some fields change (the model's name as the engine knows
    it, the stream options that make a stream end with its usage)."""
    if not changes:
        return body
    start = len(body) - len(body.lstrip(b" \t\r\n"))
    if (
        body[start : start + 1] == b"{"
        and body[start + 1 : start + 2] != b"\x00"
        and not changes.keys() & payload.keys()
    ):
        # Only new fields (UTF-8, the usual case): they go in front of the client's own, whose bytes
        # pass on as sent (a long prompt is not encoded again).
        added = _encoded(dict(changes))[1:-1]
        return body[: start + 1] + added + b"," + body[start + 1 :]
    return _encoded({**payload, **changes})


def _encoded(value: dict[str, Any]) -> bytes:
    """``value`` as JSON in UTF-8. A string the client sent as a lone surrogate escape (``"\\ud800"``), which
    UTF-8 cannot hold, is passed on escaped as it came; a value nested as deeply as Python's reader just
    managed may still be too deep to write from here (400)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
        try:
            return text.encode()
        except UnicodeEncodeError:
            return json.dumps(value).encode()
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None


async def multipart_model(request: Request, body: bytes) -> tuple[str, Callable[[str], tuple[bytes, str]]]:
    """The model a multipart request names (a form field), and how to re-encode it for another name.

    Returns (model, rewrite) where ``rewrite(upstream_model)`` gives the body and content type to
    forward; the original bytes when the name is the same.
    """
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise BadRequest(
            "this endpoint takes multipart/form-data: the audio as a file field and the model as a form field"
        )
    replay = Request(request.scope, receive=_replay(body))
    try:
        form = await replay.form()
    except Exception as exc:  # python-multipart's errors are of several kinds
        raise BadRequest(f"the multipart body could not be read ({exc})") from None
    try:
        model = _model_field(form.get("model"))
        fields: list[tuple[str, str]] = []
        files: list[tuple[str, tuple[str | None, bytes, str | None]]] = []
        for key, value in form.multi_items():
            if isinstance(value, str):
                fields.append((key, value))
            else:
                files.append((key, (value.filename, await value.read(), value.content_type)))
    finally:
        await form.close()

    def rewrite(upstream_model: str) -> tuple[bytes, str]:
        if upstream_model == model:
            return body, content_type
        data = [(k, upstream_model if k == "model" else v) for k, v in fields]
        encoded = httpx.Request("POST", "http://engine", data=dict(_grouped(data)), files=files)
        return encoded.read(), encoded.headers["content-type"]

    return model, rewrite


def _grouped(pairs: list[tuple[str, str]]) -> dict[str, str | list[str]]:
    out: dict[str, str | list[str]] = {}
    for key, value in pairs:
        if key in out:
            existing = out[key]
            out[key] = [*existing, value] if isinstance(existing, list) else [existing, value]
        else:
            out[key] = value
    return out


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def until_client_leaves(request: Request) -> None:
    """Returns once the client has gone. Its body has been read by then: nothing else comes but that."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, waiting: Awaitable[T]) -> T:
    """``waiting``'s result; when the client goes first, ``waiting`` is cancelled (a request waiting for
    its model leaves the queue, and a load nobody waits for any more can be cancelled) and ClientLeft
    is raised. Without this a request whose client left would wait on until its model was ready."""
    waiter = asyncio.current_task()
    assert waiter is not None
    left = False

    async def watch() -> None:
        nonlocal left
        await until_client_leaves(request)
        left = True
        waiter.cancel()

    # Only one task more, usually cancelled before it ever runs (the model is ready): this is the hot path.
    watcher = asyncio.ensure_future(watch())
    try:
        return await waiting
    except asyncio.CancelledError:
        if left and waiter.uncancel() == 0:
            raise ClientLeft("the client went away while its request waited for its model") from None
        raise
    finally:
        watcher.cancel()


async def send_upstream(
    upstream: Upstream,
    port: int,
    method: str,
    path: str,
    body: bytes,
    request: Request,
    content_type: str,
    added: AddedTime | None = None,
    address: str = "127.0.0.1",
    engine_key: str | None = None,
) -> EngineAnswer:
    """Send to the engine on loopback (or on its node) and return as soon as its status and headers are in."""
    headers = {name: request.headers[name] for name in FORWARD_HEADERS if name in request.headers}
    headers["content-type"] = content_type
    headers.update(bearer(engine_key))
    # Uncompressed on loopback, so that the answer's usage can be read as it passes.
    headers["accept-encoding"] = "identity"
    if added is not None:
        added.sent = time.perf_counter()
    try:
        return await upstream.send(f"http://{address}:{port}{path}", method, body, headers)
    except UpstreamError as exc:
        raise EngineUnreachable(
            f"the model's engine on port {port} did not answer ({exc}); its worker may have just stopped or crashed: retry"
        ) from exc


class UpstreamResponse(StreamingResponse):
    """The engine's answer, passed on chunk by chunk; ``on_close`` runs once it has ended or the client left.

    ``on_close`` is given, for a whole answer (not a stream of events) that reached its end, the
    seconds from the engine's last byte to the end being handed to the server; else None.
    ``content``: the answer's bytes as the client should get them, when something reads them on the
    way (the usage meter); the engine's raw bytes otherwise. ``extra_headers``: the manager's own (its
    caller's rate limits).
    """

    def __init__(
        self,
        upstream: EngineAnswer,
        on_close: Callable[[float | None], Awaitable[None] | None],
        content: AsyncIterator[bytes] | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> None:
        headers = {name: upstream.headers[name] for name in RETURN_HEADERS if name in upstream.headers}
        headers.update(extra_headers or {})
        body = content if content is not None else upstream.chunks()
        super().__init__(body, status_code=upstream.status_code, headers=headers)
        self._upstream = upstream
        self._on_close = on_close
        self._whole = not upstream.headers.get("content-type", "").startswith("text/event-stream")
        self._after_engine: float | None = None

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        ended = time.perf_counter()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self._whole:
            self._after_engine = time.perf_counter() - ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # Starlette watches for the client's disconnect while it streams and cancels the stream.
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: after a disconnect this runs inside a cancelled scope, and an unclosed upstream
            # response would leave vLLM generating for nobody.
            with anyio.CancelScope(shield=True):
                self._upstream.close()
                done = self._on_close(self._after_engine)
                if done is not None:
                    await done
