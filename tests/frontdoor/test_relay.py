"""A forwarder's relay to the manager's process: what reaches the manager is what the client sent, less
the headers of one hop (and those the client's Connection header names), and a value that cannot pass
unchanged is refused, not altered."""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from manager.frontdoor.forwarder import Relay, port_socket


async def echo_headers(scope: Scope, receive: Receive, send: Send) -> None:
    """The manager's side: answers with the raw headers it got, each byte kept (as latin-1)."""
    if scope["type"] != "http":
        return
    body = json.dumps([[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]]).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def through_relay(headers: list[tuple[bytes, bytes]]) -> httpx.Response:
    with tempfile.TemporaryDirectory() as private:
        path = Path(private) / "http.sock"
        server = uvicorn.Server(uvicorn.Config(echo_headers, uds=str(path), log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        relay = Relay(path)
        try:
            transport = httpx.ASGITransport(app=relay, client=("10.1.2.3", 5000))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7999") as client:
                return await client.get("/api/health", headers=headers)
        finally:
            await relay.close()
            server.should_exit = True
            await serving


def test_the_manager_gets_the_clients_headers_as_sent_less_those_of_one_hop():
    sent = [
        (b"x-note", "Grüße, 東京".encode()),
        (b"connection", b"keep-alive, X-Secret-Hop, host"),
        (b"x-secret-hop", b"for the next hop only"),
        (b"keep-alive", b"timeout=5"),
        (b"x-forwarded-for", b"6.6.6.6"),
    ]
    answer = asyncio.run(through_relay(sent))
    assert answer.status_code == 200
    got = {k: v.encode("latin-1") for k, v in answer.json()}
    assert got["x-note"] == "Grüße, 東京".encode()  # the same bytes, not re-encoded
    assert "x-secret-hop" not in got and "keep-alive" not in got and "connection" not in got
    assert got["x-forwarded-for"] == b"10.1.2.3"  # the client's own address, not what it claimed
    assert got["host"] == b"127.0.0.1:7999"  # kept, though the client's Connection header named it


def test_a_header_that_is_not_utf8_is_refused_not_altered():
    answer = asyncio.run(through_relay([(b"x-note", "café".encode("latin-1"))]))
    assert answer.status_code == 400
    assert "x-note" in answer.json()["detail"] and "UTF-8" in answer.json()["detail"]


def test_a_forwarder_on_every_ipv6_address_takes_ipv6_only():
    try:
        sock = port_socket("::", 0)  # bound, not listening
    except OSError:
        pytest.skip("this machine has no IPv6")
    with sock:
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
