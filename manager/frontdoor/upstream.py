"""The front door's connections to the engines: every request /v1 forwards goes out through here.

aiohttp's client, not httpx's (which the manager's control calls to engines use: probes, metrics, the
LoRA endpoints). Forwarding is the manager's hot path, and on the 2-core box httpx's client spent
0.43 ms of CPU per small request at one client and 0.87-0.95 ms at 16-64 (its connection pool polls
every idle connection's socket at each request and each release), against aiohttp's 0.05-0.10 ms
(``python -m bench.forward_clients``; bench/README.md, "The front door's own cost"). vLLM depends on aiohttp itself.

Connections are kept alive per engine; an answer read to its end gives its connection back, and an
answer closed before its end (the client left) closes its connection, which is how vLLM learns to
abort the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp

# Connecting to an engine on loopback (or on its node) is quick; generating takes as long as it takes.
CONNECT_TIMEOUT_S = 10.0
# Idle connections to an engine are closed after this long (an engine's own keep-alive is 5 s in uvicorn).
KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """The engine could not be reached, or its connection failed before its answer's headers."""


class EngineAnswer:
    """An engine's answer once its status and headers are in; its body is read as it arrives."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code = response.status
        self.headers: Mapping[str, str] = response.headers  # case-insensitive

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (undecoded: the front door asks for no compression)."""
        async for chunk in self._response.content.iter_any():
            yield chunk

    def close(self) -> None:
        """Done with the answer: its connection goes back to the pool when the body was read to its
        end, and is closed otherwise (vLLM then aborts the request)."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class Upstream:
    """One connection pool to all engines, made on first use (aiohttp wants a running event loop)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=None),
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def send(self, url: str, method: str, body: bytes, headers: Mapping[str, str]) -> EngineAnswer:
        try:
            response = await self._client().request(method, url, data=body, headers=headers, allow_redirects=False)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc
        return EngineAnswer(response)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
