"""50 SSE clients for 60 s on loopback: the manager's CPU use and each update's delay.

Against the running manager (its SSE route must send, in every message, the snapshot's sample time
as JSON "taken_at": ... or as an HTML attribute data-taken-at="..."):

    python bench/sse_fanout.py --url http://127.0.0.1:7999/api/metrics/stream \
        --pid $(pgrep -o -f 'vllm-manager serve')

Without the manager (the metrics library alone: the real collector sampling once a second and
its broadcast, behind a bare Starlette SSE route in a separate process):

    python bench/sse_fanout.py --self-serve

Delay = time a client parsed the message - the snapshot's taken_at (same host, same clock): it is
what a user sees between the sample and the page, queueing in the server included. CPU is the
server process alone (not its vLLM children), 100 % = one core, over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import psutil

TAKEN_AT = re.compile(r'(?:"taken_at"\s*:\s*|data-taken-at=")([0-9]+(?:\.[0-9]+)?)')


class ClientStats:
    def __init__(self) -> None:
        self.events = 0
        self.delays: list[float] = []
        self.errors: list[str] = []
        self.untimed = 0
        self.bytes = 0


async def client(http: httpx.AsyncClient, url: str, until: float, stats: ClientStats) -> None:
    data: list[str] = []
    try:
        async with http.stream("GET", url, headers={"Accept": "text/event-stream"}) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].lstrip())
                elif line == "" and data:
                    received = time.time()
                    stats.events += 1
                    stats.bytes += sum(len(d) for d in data)
                    match = TAKEN_AT.search("\n".join(data))
                    if stats.events == 1:
                        pass  # the snapshot a stream opens with is up to a second old by design
                    elif match:
                        stats.delays.append(received - float(match.group(1)))
                    else:
                        stats.untimed += 1
                    data = []
                if time.time() >= until:
                    return
    except (httpx.HTTPError, OSError) as exc:
        stats.errors.append(f"{type(exc).__name__}: {exc}")


async def run_clients(url: str, clients: int, seconds: float, pid: int | None) -> dict:
    server = psutil.Process(pid) if pid else None
    me = psutil.Process()
    limits = httpx.Limits(max_connections=clients + 5, max_keepalive_connections=clients + 5)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=30.0), limits=limits) as http:
        cpu0 = server.cpu_times() if server else None
        me0 = me.cpu_times()
        t0 = time.time()
        all_stats = [ClientStats() for _ in range(clients)]
        await asyncio.gather(*(client(http, url, t0 + seconds, s) for s in all_stats))
        wall = time.time() - t0
        cpu1 = server.cpu_times() if server else None
        me1 = me.cpu_times()
    delays = sorted(d for s in all_stats for d in s.delays)
    events = sum(s.events for s in all_stats)

    def ms(q: float) -> float | None:
        return round(1000 * delays[min(len(delays) - 1, int(q * len(delays)))], 1) if delays else None

    return {
        "clients": clients,
        "seconds": round(wall, 1),
        "events": events,
        "events_per_client_per_s": round(events / clients / wall, 2),
        "mean_message_bytes": round(sum(s.bytes for s in all_stats) / events) if events else None,
        "untimed_events": sum(s.untimed for s in all_stats),
        "clients_with_errors": sum(1 for s in all_stats if s.errors),
        "first_error": next((s.errors[0] for s in all_stats if s.errors), None),
        "delay_ms_p50": ms(0.50),
        "delay_ms_p95": ms(0.95),
        "delay_ms_max": round(1000 * delays[-1], 1) if delays else None,
        "delay_ms_mean": round(1000 * statistics.fmean(delays), 1) if delays else None,
        "server_cpu_pct": (
            round(100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / wall, 1)
            if cpu0 is not None and cpu1 is not None
            else None
        ),
        "server_rss_mib": round(server.memory_info().rss / 2**20) if server else None,
        "bench_clients_cpu_pct": round(100 * ((me1.user + me1.system) - (me0.user + me0.system)) / wall, 1),
        "host_cpus": psutil.cpu_count(),
    }


# --- a stand-in server for --self-serve: the metrics library behind a bare SSE route ----------


def serve(port: int, workers: int) -> None:
    import uvicorn
    from sse_starlette.sse import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.routing import Route

    from manager.metrics.collector import MetricsCollector, WorkerInfo

    # Stand-in workers: this process as their process tree, no engine to scrape; they make the
    # message as large as a real dashboard's and the tree sampling as costly.
    listed = [WorkerInfo(f"worker-{i}", "stand-in", "starting", root_pid=os.getpid()) for i in range(workers)]
    collector = MetricsCollector(lambda: listed, disks=[("data", "/")])

    async def stream(request):
        async def events():
            async for snap in collector.broadcast.subscribe():
                yield {"event": "metrics", "id": str(snap.seq), "data": snap.json}

        return EventSourceResponse(events())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        collector.start()
        yield
        await collector.stop()

    app = Starlette(routes=[Route("/api/metrics/stream", stream)], lifespan=lifespan)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="the manager's SSE URL")
    ap.add_argument("--pid", type=int, help="the manager's pid, to measure its CPU")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--self-serve", action="store_true", help="start a stand-in server (see above)")
    ap.add_argument("--workers", type=int, default=4, help="stand-in workers with --self-serve")
    ap.add_argument("--serve-only", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_only:
        serve(args.serve_only, args.workers)
        return
    proc = None
    if args.self_serve:
        port = _free_port()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--serve-only",
                str(port),
                "--workers",
                str(args.workers),
            ],
            cwd=root,
            env={**os.environ, "PYTHONPATH": root},
        )
        args.url, args.pid = f"http://127.0.0.1:{port}/api/metrics/stream", proc.pid
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(2.0)  # let the collector take its first samples
    if not args.url:
        ap.error("give --url (and --pid) of a running manager, or --self-serve")
    try:
        result = asyncio.run(run_clients(args.url, args.clients, args.seconds, args.pid))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(10)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
