"""The manager under a dashboard-and-API read load: 200 GETs a second, open loop, plus 50 live clients.

From the repository root:

    python -m bench.load --out bench/results/load.json

It starts a real ``python -m manager serve`` (own data dir and port) with an admin token, so every
read carries it (``Authorization: Bearer``, as a script would send; without it reads are a 401), stores
a few model configs and offload profiles, starts no worker, then for ``--seconds``:

- GETs at ``--rate`` a second with exponential gaps (open loop: a request goes out at its time whether
  or not earlier ones have been answered), cycling through the API reads, the pages and /metrics;
  latency counts from the moment it was due, so a late send is not hidden;
- ``--sse`` clients on the live streams, half on /api/metrics/stream (the dashboard) and half on
  /api/events/stream (quiet without workers: it sends a keep-alive comment every 15 s).

Reported: the achieved rate, latency p50/p99/max per route and per group (api, pages, prometheus),
errors (any answer but 200), each stream's messages, the gaps between them and (dashboard) each
update's delay from its sample time, as bench/sse_fanout.py measures it; the manager's CPU and RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil

from bench.rawhttp import Connection, HttpError, request_bytes
from bench.served import ROOT, cpu_seconds, free_port, manager, ms, percentile
from bench.sse_fanout import TAKEN_AT

MODELS = ["llama-8b", "qwen3-4b", "qwen3-30b-a3b", "mistral-7b", "phi-4"]
PROFILES = ["kv-16g", "lora-pool", "moe-25"]
# (path, group, weight): the reads a dashboard and scripts make, about three API reads to one page.
ROUTES = [
    ("/api/models", "api", 3),
    *((f"/api/models/{m}", "api", 1) for m in MODELS[:2]),
    ("/api/profiles", "api", 1),
    (f"/api/profiles/{PROFILES[0]}", "api", 1),
    ("/api/workers", "api", 2),
    ("/api/events", "api", 1),
    ("/api/metrics", "api", 2),
    ("/api/health", "api", 1),
    ("/v1/models", "api", 1),
    ("/", "pages", 2),
    ("/models", "pages", 1),
    (f"/models/{MODELS[0]}", "pages", 1),
    (f"/profiles/{PROFILES[1]}", "pages", 1),
    ("/ui/events", "pages", 1),
    ("/metrics", "prometheus", 1),
]
STREAMS = ["/api/metrics/stream", "/api/events/stream"]


def store_configs(url: str, auth: dict[str, str]) -> None:
    for i, name in enumerate(MODELS):
        body = {"name": name, "model": f"/models/{name}", "gpu_ids": [i % 2], "max_model_len": 8192}
        httpx.post(f"{url}/api/models", json=body, headers=auth, timeout=60).raise_for_status()
    shapes: list[dict] = [{"kv_offload_gib": 16}, {"lora_cpu_pooling": True, "lora_pool_gib": 4}, {}]
    for name, shape in zip(PROFILES, shapes, strict=True):
        body = {"name": name, "description": "bench", **shape}
        httpx.post(f"{url}/api/profiles", json=body, headers=auth, timeout=60).raise_for_status()


@dataclass
class Reads:
    latency: dict[str, list[float]] = field(default_factory=dict)  # per path, s
    lag: list[float] = field(default_factory=list)  # sent - due, s
    errors: list[str] = field(default_factory=list)
    sent: int = 0
    done: int = 0
    connections: int = 0


async def read_load(port: int, auth: dict[str, str], rate: float, seconds: float, seed: int) -> tuple[Reads, float]:
    cycle = [(path, group) for path, group, weight in ROUTES for _ in range(weight)]
    random.Random(seed).shuffle(cycle)
    raws = {
        path: request_bytes("GET", path, port, headers={**auth, "Accept": "text/html" if group == "pages" else "*/*"})
        for path, group in cycle
    }
    gaps = random.Random(seed + 1)
    idle: list[Connection] = []
    out = Reads()
    tasks: set[asyncio.Task] = set()

    async def one(path: str, due: float) -> None:
        if idle:
            conn = idle.pop()
        else:
            conn = Connection(port)
            out.connections += 1
        out.lag.append(time.perf_counter() - due)
        try:
            answer = await conn.fetch(raws[path])
        except (HttpError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            out.errors.append(f"{path}: {type(exc).__name__}: {exc}")
            await conn.close()
            return
        out.latency.setdefault(path, []).append(time.perf_counter() - due)
        out.done += 1
        if answer.status != 200:
            out.errors.append(f"{path}: HTTP {answer.status}: {answer.body[:200]!r}")
        idle.append(conn)

    start = time.perf_counter()
    due = start
    while due < start + seconds:
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        path, _ = cycle[out.sent % len(cycle)]
        task = asyncio.create_task(one(path, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        out.sent += 1
        due += gaps.expovariate(rate)
    sending = time.perf_counter() - start
    await asyncio.gather(*tasks)
    return out, sending


@dataclass
class Listener:
    path: str
    messages: int = 0
    pings: int = 0
    arrivals: list[float] = field(default_factory=list)  # of each message, or each new sample time
    delays: list[float] = field(default_factory=list)
    last_stamp: str | None = None
    errors: list[str] = field(default_factory=list)


async def listen(port: int, auth: dict[str, str], client: Listener) -> None:
    conn = Connection(port)
    raw = request_bytes("GET", client.path, port, headers={**auth, "Accept": "text/event-stream"})
    try:
        async for arrived, data in conn.events(raw):
            if not data:
                client.pings += 1  # a comment line only: the keep-alive
                continue
            client.messages += 1
            stamp = TAKEN_AT.search(data.decode(errors="replace"))
            if stamp is None:
                client.arrivals.append(arrived)
                continue
            if stamp.group(1) == client.last_stamp:
                continue  # another part (an HTML fragment) of the same update
            client.last_stamp = stamp.group(1)
            client.arrivals.append(arrived)
            # The first update replays the latest snapshot, up to a second old by design.
            if len(client.arrivals) > 1:
                client.delays.append(arrived - float(stamp.group(1)))
        client.errors.append("the stream ended")
    except (HttpError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
        client.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        await conn.close()


async def watch_process(pid: int, every_s: float, rss: list[int], stop: asyncio.Event) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        rss.append(proc.memory_info().rss)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


def figures(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    return {
        "n": len(ordered),
        "p50": ms(percentile(ordered, 0.5)),
        "p99": ms(percentile(ordered, 0.99)),
        "max": ms(ordered[-1]),
    }


async def run(args: argparse.Namespace, port: int, pid: int, auth: dict[str, str]) -> dict:
    listeners = [Listener(STREAMS[i % len(STREAMS)]) for i in range(args.sse)]
    streams = [asyncio.create_task(listen(port, auth, c)) for c in listeners]
    await asyncio.sleep(2.0)  # every stream open and past its first message
    rss: list[int] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_process(pid, 1.0, rss, stop))
    me = psutil.Process()
    cpu0, mine0, t0 = cpu_seconds(pid), sum(me.cpu_times()[:2]), time.perf_counter()
    reads, sending = await read_load(port, auth, args.rate, args.seconds, args.seed)
    wall = time.perf_counter() - t0
    cpu, mine = cpu_seconds(pid) - cpu0, sum(me.cpu_times()[:2]) - mine0
    stop.set()
    await watcher
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)

    groups: dict[str, list[float]] = {}
    for path, group, _ in ROUTES:
        groups.setdefault(group, []).extend(reads.latency.get(path, []))
    by_stream: dict = {}
    for path in STREAMS:
        mine_ = [c for c in listeners if c.path == path]
        gaps = [b - a for c in mine_ for a, b in zip(c.arrivals, c.arrivals[1:], strict=False)]
        by_stream[path] = {
            "clients": len(mine_),
            "messages": sum(c.messages for c in mine_),
            "messages_per_client_per_s": round(sum(c.messages for c in mine_) / len(mine_) / wall, 2) if mine_ else 0,
            "keepalive_comments": sum(c.pings for c in mine_),
            # Between updates: messages carrying the same sample time are one update.
            "updates": sum(len(c.arrivals) for c in mine_),
            "gap_between_updates_ms": figures(gaps),
            "update_delay_ms": figures([d for c in mine_ for d in c.delays]),
            "clients_with_errors": sum(1 for c in mine_ if c.errors),
            "first_error": next((c.errors[0] for c in mine_ if c.errors), None),
        }
    return {
        "reads": {
            "target_per_s": args.rate,
            "sent": reads.sent,
            "answered": reads.done,
            "sent_per_s": round(reads.sent / sending, 1),
            "answered_per_s": round(reads.done / wall, 1),
            "errors": len(reads.errors),
            "first_errors": reads.errors[:5],
            "connections_opened": reads.connections,
            "send_lag_ms": figures(reads.lag),
            "latency_ms_by_group": {g: figures(v) for g, v in groups.items()},
            "latency_ms_by_route": {p: figures(reads.latency.get(p, [])) for p, _, _ in ROUTES},
        },
        "streams": by_stream,
        "manager": {
            "cpu_pct_of_one_core": round(100 * cpu / wall, 1),
            "rss_mib": {
                "start": round(rss[0] / 2**20) if rss else None,
                "end": round(rss[-1] / 2**20) if rss else None,
                "max": round(max(rss) / 2**20) if rss else None,
            },
        },
        "load_generator_cpu_pct": round(100 * mine / wall, 1),
        "seconds": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200.0, help="GETs a second")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--sse", type=int, default=50, help="live clients, half on each stream")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-load-"))
    token = secrets.token_urlsafe(32)
    auth = {"Authorization": f"Bearer {token}"}
    result: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_average_before": os.getloadavg()},
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "command": " ".join(["python", "-m", "bench.load", *sys.argv[1:]]),
        "setup": f"{len(MODELS)} model configs, {len(PROFILES)} offload profiles, no worker; admin token set, "
        "every read sends it",
        "routes": [{"path": p, "group": g, "weight": w} for p, g, w in ROUTES],
    }
    data = work / "data"
    data.mkdir()
    with manager(data, free_port(), {"VLLM_MANAGER_API_TOKEN": token}) as mgr:
        store_configs(mgr.url, auth)
        assert httpx.get(f"{mgr.url}/api/models", timeout=10).status_code == 401  # reads need the token
        time.sleep(2.0)  # the collector's first samples
        result.update(asyncio.run(run(args, mgr.port, mgr.pid, auth)))
    result["host"]["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
