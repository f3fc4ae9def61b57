"""Writes the manager acknowledged survive kill -9: concurrent clients create model configs, the manager
is killed with SIGKILL at a random moment, started again on the same data dir, and every config it
answered 201 for must be there (and readable whole).

From the repository root:

    python -m bench.crash_writes --runs 5 --out bench/results/crash_writes.json

Each run: ``--clients`` writers POST configs (each with an alias, extra_args and env, so every write
touches the config table and the routing-name table) as fast as they are answered; after a random
0.5-``--max-s`` seconds the manager gets SIGKILL. A write counts as acknowledged only when its 201
arrived; one cut off by the kill may or may not be stored (both are fine), but an acknowledged one
missing, or a stored config that does not read back as written, is a loss.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from bench.served import free_port, manager


def body(run: int, client: int, n: int) -> dict:
    name = f"r{run}-c{client}-{n}"
    return {
        "name": name,
        "model": f"/models/{name}",
        "aliases": [f"{name}-alias"],
        "max_model_len": 1024 + n,
        "extra_args": ["--load-format", "dummy"],
        "env": {"VLLM_LOGGING_LEVEL": "INFO"},
    }


def one_run(run: int, data_dir: Path, clients: int, max_s: float, rng: random.Random) -> dict:
    port = free_port()
    acknowledged: dict[str, dict] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def writer(client: int, url: str) -> None:
        n = 0
        with httpx.Client(base_url=url, timeout=10) as http:
            while not stop.is_set():
                sent = body(run, client, n)
                n += 1
                try:
                    answer = http.post("/api/models", json=sent)
                except httpx.HTTPError:
                    return  # the manager is gone
                if answer.status_code == 201:
                    with lock:
                        acknowledged[sent["name"]] = sent

    with manager(data_dir, port) as server:
        threads = [threading.Thread(target=writer, args=(c, server.url)) for c in range(clients)]
        for t in threads:
            t.start()
        kill_after = rng.uniform(0.5, max_s)
        time.sleep(kill_after)
        os.killpg(server.pid, signal.SIGKILL)
        server.proc.wait(10)
        stop.set()
        for t in threads:
            t.join(15)
    lost, altered = [], []
    with manager(data_dir, port) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        stored = {m["name"]: m for m in http.get("/api/models").json()}
        for name, sent in acknowledged.items():
            got = stored.get(name)
            if got is None:
                lost.append(name)
            elif any(got[k] != sent[k] for k in ("aliases", "max_model_len", "extra_args", "env")):
                altered.append(name)
        after = http.post("/api/models", json=body(run, 999, 0)).status_code  # the store still takes writes
    return {
        "run": run,
        "killed_after_s": round(kill_after, 3),
        "acknowledged": len(acknowledged),
        "stored_after_restart": sum(1 for n in stored if n.startswith(f"r{run}-")),
        "lost": lost,
        "altered": altered,
        "write_after_restart_status": after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-s", type=float, default=4.0, help="latest moment of the kill after the writes begin")
    parser.add_argument("--seed", type=int, default=20261125)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="crash-writes-") as tmp:
        data_dir = Path(tmp) / "data"
        runs = [one_run(i, data_dir, args.clients, args.max_s, rng) for i in range(args.runs)]
    summary = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "clients": args.clients,
        "acknowledged": sum(r["acknowledged"] for r in runs),
        "lost": sum(len(r["lost"]) for r in runs),
        "altered": sum(len(r["altered"]) for r in runs),
        "runs": runs,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
