"""A small keep-alive HTTP/1.1 client on asyncio streams, for load generators on a small machine.

A benchmark that shares two cores with the server it measures must spend as little CPU per request
as it can: this client writes prepared bytes and reads the answer (Content-Length or chunked), with
no URL parsing, header objects or decoding. A request that meets a kept-alive connection the server
has just closed, before any answer, is sent again once on a new connection. ``Connection.events``
yields each Server-Sent Event with the moment it was complete. It speaks only to servers that answer
HTTP/1.1 correctly (no 1xx, no trailers).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass


class HttpError(Exception):
    pass


@dataclass
class Answer:
    status: int
    body: bytes


def request_bytes(method: str, path: str, port: int, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method in ("POST", "PUT", "PATCH"):
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Connection:
    """One keep-alive connection; reopened when the server closes it."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.opened = 0  # how many times a connection was opened

    async def _ensure(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
            self.opened += 1
        return self.reader, self.writer

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    async def send(self, raw: bytes) -> tuple[int, dict[bytes, bytes]]:
        reused = self.reader is not None
        if self.reader is not None and self.reader.at_eof():
            await self.close()  # the server closed it while it was idle
        reader, writer = await self._ensure()
        try:
            writer.write(raw)
            status_line = await reader.readline()
        except ConnectionResetError:
            if not reused:
                raise
            status_line = b""
        if not status_line and reused:
            # The server's idle timeout closed a kept-alive connection just as this request went out:
            # nothing was answered, so it is sent again on a new one, as HTTP clients do.
            await self.close()
            reader, writer = await self._ensure()
            writer.write(raw)
            status_line = await reader.readline()
        if not status_line:
            raise HttpError("the server closed the connection")
        status = int(status_line.split(b" ", 2)[1])
        headers: dict[bytes, bytes] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def body_parts(self, headers: dict[bytes, bytes]) -> AsyncIterator[bytes]:
        assert self.reader is not None
        reader = self.reader
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif b"content-length" in headers:
            length = int(headers[b"content-length"])
            if length:
                yield await reader.readexactly(length)
        else:  # to the end of the connection
            while data := await reader.read(65536):
                yield data
            await self.close()
            return
        if headers.get(b"connection", b"").lower() == b"close":
            await self.close()

    async def fetch(self, raw: bytes) -> Answer:
        status, headers = await self.send(raw)
        parts = [part async for part in self.body_parts(headers)]
        return Answer(status, b"".join(parts))

    async def events(self, raw: bytes) -> AsyncIterator[tuple[float, bytes]]:
        """(time.time() when complete, data) of each SSE event; raises HttpError on a non-200 answer."""
        status, headers = await self.send(raw)
        if status != 200:
            body = b"".join([part async for part in self.body_parts(headers)])
            raise HttpError(f"HTTP {status}: {body[:300]!r}")
        pending = b""
        async for part in self.body_parts(headers):
            # sse-starlette ends lines with CRLF, vLLM and uvicorn apps with LF.
            pending = (pending + part).replace(b"\r\n", b"\n")
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                now = time.time()
                data = b"\n".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
                yield now, data
