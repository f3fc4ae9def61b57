"""The forwarding client alone: CPU per small request of httpx, httpcore and aiohttp against one upstream.

    python -m bench.forward_clients [--requests 3200] [--levels 1 16 64]

Why the front door forwards through aiohttp (manager/frontdoor/upstream.py). bench/fast_upstream.py
runs on a free port; in this process, under uvloop, N tasks each send chat completions one after the
other (20 untimed each first), reading every answer to its end, through:

- ``httpx``: one ``AsyncClient`` as the front door used it (``build_request``, ``send(stream=True)``,
  ``aiter_raw``, ``aclose``; the runtime's old limits: 2,048 connections, 256 kept alive);
- ``httpcore``: httpx's transport without its pool, connections kept on a plain idle list;
- ``aiohttp``: one ``ClientSession`` as ``manager.frontdoor.upstream`` makes it.

It prints, per client and level, requests a second and this process's CPU (user + system) per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpcore
import httpx
import uvloop

from bench.served import free_port, started
from manager.frontdoor.upstream import Upstream

BODY = b'{"model":"fast","messages":[{"role":"user","content":"hello"}],"max_tokens":16}'
HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def client_calls(kind: str, port: int) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    """One request through ``kind`` (read to its end), and how to close the client."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    if kind == "httpx":
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256))

        async def one_httpx() -> None:
            answer = await http.send(http.build_request("POST", url, content=BODY, headers=HEADERS), stream=True)
            async for _ in answer.aiter_raw():
                pass
            await answer.aclose()

        return one_httpx, http.aclose
    if kind == "httpcore":
        idle: list[httpcore.AsyncHTTPConnection] = []
        origin = httpcore.Origin(b"http", b"127.0.0.1", port)
        headers = [(b"host", f"127.0.0.1:{port}".encode()), (b"content-length", str(len(BODY)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in HEADERS.items()]

        async def one_httpcore() -> None:
            conn = idle.pop() if idle else httpcore.AsyncHTTPConnection(origin)
            answer = await conn.handle_async_request(httpcore.Request("POST", url, headers=headers, content=BODY))
            async for _ in answer.stream:  # type: ignore[union-attr]
                pass
            await answer.aclose()
            idle.append(conn)

        async def close_all() -> None:
            for conn in idle:
                await conn.aclose()

        return one_httpcore, close_all
    upstream = Upstream()

    async def one_aiohttp() -> None:
        answer = await upstream.send(url, "POST", BODY, HEADERS)
        async for _ in answer.chunks():
            pass
        answer.close()

    return one_aiohttp, upstream.close


async def level(kind: str, port: int, clients: int, requests: int) -> dict[str, float]:
    one, close = await client_calls(kind, port)

    async def loop(count: int) -> None:
        for _ in range(count):
            await one()

    try:
        await asyncio.gather(*(loop(20) for _ in range(clients)))
        t0, c0 = time.perf_counter(), cpu_s()
        await asyncio.gather(*(loop(requests // clients) for _ in range(clients)))
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    finally:
        await close()
    done = requests // clients * clients
    return {"requests_per_s": round(done / wall), "cpu_ms_per_request": round(1000 * cpu / done, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3200)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="bench-forward-clients-")) / "upstream.log"
    argv = [sys.executable, "bench/fast_upstream.py", "--model", "fast", "--port", str(port)]
    out: dict[str, dict[str, dict[str, float]]] = {}
    with started(argv, port, log, "/health"):
        for clients in args.levels:
            for kind in ("httpx", "httpcore", "aiohttp"):
                got = uvloop.run(level(kind, port, clients, args.requests))
                out.setdefault(str(clients), {})[kind] = got
                print(f"{clients:>3} clients, {kind:8s}: {got}", flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
