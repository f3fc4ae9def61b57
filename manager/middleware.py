"""HTTP guards the whole app shares, as plain ASGI middleware (they see every request, pages and API)."""

from __future__ import annotations

from urllib.parse import urlsplit

import anyio
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from manager.refusals import refused_before_routing


def _size(n: int) -> str:
    return f"{n / 1024**2:g} MiB" if n >= 1024**2 else f"{n / 1024:g} KiB"


class BodyLimit:
    """A request body over its limit is a 413, decided from Content-Length before anything is read, or
    while a body without one streams in. ``by_path`` gives some paths (the import) a limit of their own,
    or None where the route enforces its own (the /v1 front door, which answers in OpenAI's shape)."""

    def __init__(self, app: ASGIApp, default: int, by_path: dict[str, tuple[int, str] | None] | None = None) -> None:
        self.app = app
        self.default = default
        self.by_path = by_path or {}

    def _limit(self, path: str) -> tuple[int, str] | None:
        return self.by_path.get(path, (self.default, "VLLM_MANAGER_MAX_BODY_BYTES"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = self._limit(scope["path"])
        if found is None:  # the route keeps a limit of its own, and answers in its own error shape
            await self.app(scope, receive, send)
            return
        limit, setting = found
        too_large = HTTPException(
            413, f"the request body is larger than {_size(limit)}, the most this manager takes here ({setting})"
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await refused_before_routing(scope, 413, too_large.detail)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises an HTTPException met while it reads the body; the app's
                    # exception handling turns it into the JSON 413.
                    raise too_large
            return message

        await self.app(scope, counted, send)


class HeadAsGet:
    """HEAD is answered wherever GET is: the request runs as a GET and only its status and headers go
    out (FastAPI's routes declared with ``@router.get`` answer HEAD with a 405 otherwise). An endless
    response (a live stream) is stopped once its headers are out."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        finished = False

        with anyio.CancelScope() as run:

            async def headers_only(message: Message) -> None:
                nonlocal finished
                if message["type"] == "http.response.start":
                    await send(message)
                elif message["type"] == "http.response.body" and not finished:
                    finished = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    if message.get("more_body", False):
                        run.cancel()

            await self.app({**scope, "method": "GET"}, receive, headers_only)


class FramingForbidden:
    """No page of the manager may be shown in a frame on another site (clickjacking): every response
    says so, in the header old browsers read and in the CSP directive new ones do."""

    HEADERS = ((b"x-frame-options", b"DENY"), (b"content-security-policy", b"frame-ancestors 'none'"))

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(name, value) for name, value in self.HEADERS if name not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class TrustedHosts:
    """A request must name this manager by one of its host names, so that a web page on a domain that
    resolves to this machine (DNS rebinding) cannot reach it; others get a 400 in the API's error shape.
    Patterns as Starlette's: a name, "*.example.com", or "*" for any."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed = [pattern.lower() for pattern in allowed_hosts]

    def _allows(self, host: str | None) -> bool:
        if "*" in self.allowed:
            return True
        if not host:
            return False
        return any(host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("host", "")
        try:
            host = urlsplit(f"//{given}").hostname
        except ValueError:
            host = None
        if self._allows(host):
            await self.app(scope, receive, send)
            return
        message = (
            f"this manager does not answer to the host name {given!r}: use one of {', '.join(self.allowed)}, "
            "or add it to VLLM_MANAGER_ALLOWED_HOSTS"
        )
        await refused_before_routing(scope, 400, message)(scope, receive, send)
