"""One forwarder process: it takes connections on the manager's HTTP port beside the others, forwards
/v1 requests to the engines itself, and passes every other request to the manager's process.

A forwarder checks the caller and resolves the model from the store as the manager does (its own
read of the same SQLite file), asks the manager's process for each lease (``lease_channel``) and
tells it how each request ended, so the scheduler, the metrics and the usage table stay the
manager's alone. It ends when the manager's process closes the lease channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from yarl import URL

from manager.db import make_engine
from manager.frontdoor.access import inference_caller
from manager.frontdoor.catalog import Catalog
from manager.frontdoor.errors import FrontDoorError
from manager.frontdoor.forwarding import Forwarding
from manager.frontdoor.lease_channel import LeaseClient
from manager.frontdoor.upstream import KEEPALIVE_S, EngineAnswer, Upstream
from manager.inference_endpoints import JSON_ENDPOINTS, MULTIPART_ENDPOINTS
from manager.middleware import FramingForbidden, TrustedHosts
from manager.refusals import refusal
from manager.request_checks import client_address
from manager.settings import Settings

log = logging.getLogger("vllm_manager.frontdoor")

# Headers of one hop only: the relay makes its own. The client's forwarding headers are replaced, so
# that the manager's process learns the client's real address (it trusts the relay's, no one else's).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "x-forwarded-for",
        "x-forwarded-proto",
    }
)


DRAIN_S = 30

NOT_RELAYED_BACK = HOP_BY_HOP | {"date", "server"}


@dataclass(frozen=True)
class Sockets:
    """Where a forwarder reaches the manager's process: its HTTP server and its lease channel."""

    http: Path
    leases: Path


def relayed_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The request's headers for the manager's process: those of one hop left out, with those the
    client's ``Connection`` names, and each value sent as the same bytes (the relay's client writes
    UTF-8). ValueError naming a header whose value is not UTF-8, which could not pass unchanged."""
    named = {
        token.strip().lower() for name, value in raw if name.lower() == b"connection" for token in value.split(b",")
    }
    left_out = HOP_BY_HOP | {token.decode("latin-1") for token in named if token != b"host"}
    headers = []
    for name, value in raw:
        key = name.decode("latin-1").lower()
        if key in left_out:
            continue
        try:
            headers.append((key, value.decode("utf-8")))
        except UnicodeDecodeError:
            raise ValueError(f"the value of the {key} header is not UTF-8; send it as UTF-8 or ASCII") from None
    return headers


class Relay:
    """Passes a request to the manager's process and its answer back, both streamed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # Idle connections closed before the manager's server would (uvicorn: after 5 s).
                connector=aiohttp.UnixConnector(path=str(self.path), limit=0, keepalive_timeout=KEEPALIVE_S),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            headers = relayed_headers(scope["headers"])
        except ValueError as exc:
            await refusal(scope["path"], 400, str(exc))(scope, receive, send)
            return
        headers += [("x-forwarded-for", client_address(request)), ("x-forwarded-proto", scope.get("scheme", "http"))]
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        path = scope.get("raw_path", b"").decode("latin-1") or scope["path"]
        query = scope.get("query_string", b"").decode("latin-1")
        # As the client wrote them: neither is decoded and encoded again on the way.
        target = URL.build(scheme="http", host="manager", path=path, query_string=query, encoded=True)
        try:
            answer = await self._client().request(
                scope["method"],
                target,
                headers=headers,
                data=request.stream() if has_body else None,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError) as exc:
            message = f"the manager's main process did not answer ({type(exc).__name__}); retry"
            await refusal(scope["path"], 502, message)(scope, receive, send)
            return

        relayed = EngineAnswer(answer)  # read as /v1 reads an engine's: its connection kept when read to the end
        response = StreamingResponse(relayed.chunks(), status_code=relayed.status_code)
        # The forwarder's server writes its own date and server headers.
        response.raw_headers = [
            (k.lower(), v) for k, v in answer.raw_headers if k.decode("latin-1").lower() not in NOT_RELAYED_BACK
        ]
        try:
            await response(scope, receive, send)
        finally:
            relayed.close()


class ForwarderApp:
    """The forwarder's ASGI app: POSTs to /v1's endpoints are forwarded here, the rest is relayed."""

    def __init__(self, settings: Settings, sockets: Sockets) -> None:
        self.settings = settings
        self.sockets = sockets
        self.catalog = Catalog(make_engine(settings.db_path))
        self.leases = LeaseClient()
        self.upstream = Upstream()
        self.forwarding = Forwarding(
            self.upstream,
            settings.proxy_max_body_bytes,
            self.catalog.resolve,
            self.leases,
            self.leases,
            self.leases,
            loading_progress=self.catalog.loading_progress,
        )
        self.relay = Relay(sockets.http)
        self.handlers = {
            **{path: self.forwarding.forward_json for path in JSON_ENDPOINTS},
            **{path: self.forwarding.forward_multipart for path in MULTIPART_ENDPOINTS},
        }
        self.server: uvicorn.Server | None = None
        guarded: ASGIApp = TrustedHosts(self._route, allowed_hosts=settings.trusted_hosts())
        self.guarded: ASGIApp = FramingForbidden(guarded)
        self._watch: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self.guarded(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.relay(scope, receive, send)
            return
        request = Request(scope, receive)
        response: Response
        try:
            # Wrong tokens count in the manager's own limit (the lease channel tells it), not one of ours.
            caller = inference_caller(request, self.catalog, self.settings, self.leases.throttles)
            response = await handler(request, scope["path"], caller)
        except FrontDoorError as exc:
            response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        except Exception:
            log.exception("forwarding %s failed", scope["path"])
            body = {"error": {"message": "internal error", "type": "server_error", "param": None, "code": None}}
            response = JSONResponse(body, status_code=500)
        await response(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.leases.connect(self.sockets.leases)
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                self._watch = asyncio.create_task(self._end_with_manager())
                gc.collect()
                gc.freeze()  # as the manager's process does (manager.app): no full passes over the start's objects
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._watch is not None:
                    self._watch.cancel()
                await self.leases.close()
                await self.upstream.close()
                await self.relay.close()
                self.catalog.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _end_with_manager(self) -> None:
        await self.leases.lost.wait()
        log.warning("the manager's process closed the lease channel: this forwarder stops")
        if self.server is not None:
            self.server.should_exit = True


def port_socket(host: str, port: int, *, shared: bool = True) -> socket.socket:
    """A socket bound to the manager's address. Shared, it shares the address (SO_REUSEPORT) with the
    other forwarders' and the manager's: the kernel spreads new connections evenly over those that
    listen. (One socket listened on by all would not: the first process to wake takes every waiting
    connection.) Only processes of the same user may join."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:  # IPv6 only, as the manager's server binds "::" without forwarders
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run(settings: Settings, sockets: Sockets, number: int) -> None:
    """A forwarder process's main: take connections on the manager's port until its process goes away."""
    listening = port_socket(settings.host, settings.port)
    app = ForwarderApp(settings, sockets)
    # Stopped, it finishes the requests it has (streams included) for up to DRAIN_S.
    # A client's X-Forwarded-For is believed only from a proxy the admin named: the relay passes on the
    # address found here, which the manager's process believes (manager.frontdoor.forwarders).
    config = uvicorn.Config(
        app,
        log_level="info",
        access_log=settings.access_log,
        lifespan="on",
        timeout_graceful_shutdown=DRAIN_S,
        **settings.proxy_header_options(),
    )
    server = uvicorn.Server(config)
    app.server = server
    log.info("forwarder %d (pid %s) takes /v1 requests", number, os.getpid())
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[listening])
