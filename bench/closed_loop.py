"""Closed-loop load on one target: N clients, each on its own keep-alive connection, each sending its
next request as soon as its previous answer is complete. Used by bench/proxy.py.

One batch measures either whole answers (latency from writing the request to the last byte of the
answer) or streams (time to the first SSE chunk, the gap between consecutive chunks, and, when the
upstream stamps each chunk's text with ``@<unix time it was written>`` as bench/fast_upstream.py
does, each chunk's delay from the upstream writing it to the client having parsed it), and the CPU
that the named processes spent meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from bench.rawhttp import Connection, HttpError, request_bytes
from bench.served import cpu_seconds, ms, percentile

STAMP = re.compile(rb"@(\d+\.\d+)")


@dataclass
class Target:
    """One way to reach the same model: its port, the path and the body it takes."""

    name: str
    port: int
    path: str
    model: str
    extra: dict = field(default_factory=dict)  # more body fields (vLLM: ignore_eos)
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Samples:
    latency: list[float] = field(default_factory=list)  # whole answers, s
    first_chunk: list[float] = field(default_factory=list)  # streams, s
    gaps: list[float] = field(default_factory=list)  # between consecutive chunks of a stream, s
    transit: list[float] = field(default_factory=list)  # upstream wrote a chunk -> client parsed it, s
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process name, over the timed part
    client_cpu_s: float = 0.0

    def add(self, other: Samples) -> None:
        for name in ("latency", "first_chunk", "gaps", "transit", "errors"):
            getattr(self, name).extend(getattr(other, name))
        self.requests += other.requests
        self.wall_s += other.wall_s
        self.client_cpu_s += other.client_cpu_s
        for name, value in other.cpu_s.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + value

    def summary(self) -> dict:
        out: dict = {"requests": self.requests, "errors": len(self.errors), "seconds": round(self.wall_s, 2)}
        if self.errors:
            out["first_error"] = self.errors[0]
        out["requests_per_s"] = round(self.requests / self.wall_s, 1) if self.wall_s else None
        for name in ("latency", "first_chunk", "gaps", "transit"):
            values = sorted(getattr(self, name))
            if values:
                out[name + "_ms"] = {
                    "p50": ms(percentile(values, 0.5)),
                    "p90": ms(percentile(values, 0.9)),
                    "p99": ms(percentile(values, 0.99)),
                    "max": ms(values[-1]),
                    "n": len(values),
                }
        # CPU seconds per 1,000 requests (= CPU milliseconds per request).
        out["cpu_s_per_1000"] = {k: round(1000 * v / self.requests, 3) for k, v in self.cpu_s.items() if self.requests}
        out["client_cpu_s_per_1000"] = round(1000 * self.client_cpu_s / self.requests, 3) if self.requests else None
        return out


def body_of(target: Target, stream: bool, max_tokens: int) -> bytes:
    payload = {
        "model": target.model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **target.extra,
    }
    return json.dumps(payload).encode()


async def _one_whole(conn: Connection, raw: bytes, out: Samples) -> None:
    t0 = time.perf_counter()
    answer = await conn.fetch(raw)
    elapsed = time.perf_counter() - t0
    if answer.status != 200:
        raise HttpError(f"HTTP {answer.status}: {answer.body[:300]!r}")
    out.latency.append(elapsed)


async def _one_stream(conn: Connection, raw: bytes, out: Samples) -> None:
    t0 = time.time()
    previous: float | None = None
    chunks = 0
    async for arrived, data in conn.events(raw):
        if data == b"[DONE]" or not _has_text(data):
            continue  # vLLM's role-only first chunk, a closing chunk with only finish_reason or usage
        if previous is None:
            out.first_chunk.append(arrived - t0)
        else:
            out.gaps.append(arrived - previous)
        previous = arrived
        chunks += 1
        stamp = STAMP.search(data)
        if stamp:
            out.transit.append(arrived - float(stamp.group(1)))
    if not chunks:
        raise HttpError("the stream ended without a chunk")


def _has_text(data: bytes) -> bool:
    try:
        choices = json.loads(data).get("choices") or [{}]
    except ValueError:
        return False
    choice = choices[0]
    return bool((choice.get("delta") or {}).get("content") or choice.get("text"))


async def batch(
    target: Target,
    clients: int,
    requests: int,
    stream: bool,
    max_tokens: int,
    processes: dict[str, list[int]],
    think_s: float = 0.0,
) -> Samples:
    """``requests`` requests by ``clients`` concurrent clients (after two untimed ones per client);
    ``processes``: name -> pids whose CPU is added up over the timed part. ``think_s``: each client
    waits a random time of this mean (exponential, seeded) between an answer and its next request,
    so that the clients send on their own schedules, as independent users do, not all at once."""
    raw = request_bytes("POST", target.path, target.port, body_of(target, stream, max_tokens), target.headers)
    one: Callable = _one_stream if stream else _one_whole
    conns = [Connection(target.port) for _ in range(clients)]
    warm = Samples()
    for _ in range(2):
        await asyncio.gather(*(one(c, raw, warm) for c in conns))
    out = Samples()
    left = requests

    async def client(conn: Connection, pause: random.Random) -> None:
        nonlocal left
        if think_s:
            await asyncio.sleep(pause.uniform(0, 2 * think_s))  # spread the first requests
        while left > 0:
            left -= 1
            try:
                await one(conn, raw, out)
            except (HttpError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
                out.errors.append(f"{type(exc).__name__}: {exc}")
                await conn.close()
            out.requests += 1
            if think_s:
                await asyncio.sleep(pause.expovariate(1 / think_s))

    me = psutil.Process()
    cpu0 = {name: sum(cpu_seconds(p) for p in pids) for name, pids in processes.items()}
    mine0 = sum(me.cpu_times()[:2])
    t0 = time.perf_counter()
    await asyncio.gather(*(client(c, random.Random(i)) for i, c in enumerate(conns)))
    out.wall_s = time.perf_counter() - t0
    out.client_cpu_s = sum(me.cpu_times()[:2]) - mine0
    out.cpu_s = {name: sum(cpu_seconds(p) for p in pids) - cpu0[name] for name, pids in processes.items()}
    await asyncio.gather(*(c.close() for c in conns))
    return out
