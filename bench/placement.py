"""How long one placement decision takes: 32 nodes x 8 GPUs x 200 workers (target: under 5 ms).

    ~/.cache/vllm-manager/test-venv/bin/python bench/placement.py --out bench/results

Snapshots are generated with a fixed seed: every node has 8 GPUs of 80 GiB; 200 workers are spread
over the nodes so that every GPU 0 and 1 holds one, each on 1, 2 or 4 GPUs of its node, holding 25
to 70 GiB on each (so a 60 GiB share never fits beside one), some persistent, some with requests in
flight, some may sleep. Four cases are timed: a model free to run on any node when every node is
full (the worst case: every node is checked and the cheapest eviction is picked), the same with one
node left with room, a model bound to one node (the first where room can be made), and the first
case with every worker and the need given as shares of a GPU, as the front door gives them in a
cluster. Each case runs ``--runs`` times; the figures are wall time per ``decide`` call, and its CPU
time (the thread's), which a busy box does not stretch.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from manager.placement import MakeRoom, Need, Node, RunningWorker, Snapshot, decide

G = 1 << 30


def snapshot(nodes: int, gpus: int, workers: int, seed: int, leave_room_on: str | None = None) -> Snapshot:
    rng = random.Random(seed)
    names = [f"node-{i:02d}" for i in range(nodes)]
    running = []
    for wid in range(1, workers + 1):
        node = names[wid % nodes]
        if node == leave_room_on:
            node = names[(wid + 1) % nodes]
        # Round by round over the nodes, each round one pair of GPUs further: every GPU holds a worker.
        span = rng.choice((1, 2, 2, 2, 4)) if (wid // nodes) % (gpus // 2) else 2
        first = min((wid // nodes) * 2 % gpus, gpus - span)
        running.append(
            RunningWorker(
                id=wid,
                config=f"model-{wid}",
                gpus=tuple(range(first, first + span)),
                gpu_bytes=rng.randint(25, 70) * G,
                last_request_at=rng.uniform(0, 1000),
                in_flight=rng.choice((0, 0, 0, 1, 4)),
                persistent=rng.random() < 0.1,
                may_sleep=rng.random() < 0.5,
                node=node,
            )
        )
    return Snapshot(tuple(Node(name, {g: 80 * G for g in range(gpus)}) for name in names), tuple(running))


def as_shares(snap: Snapshot) -> Snapshot:
    workers = tuple(replace(w, gpu_bytes=None, gpu_share=(w.gpu_bytes or 0) / (80 * G)) for w in snap.workers)
    return replace(snap, workers=workers)


def timed(need: Need, snap: Snapshot, runs: int) -> dict[str, object]:
    decision = decide(need, snap)
    times, cpu = [], []
    for _ in range(runs):
        started, cpu_started = time.perf_counter(), time.thread_time()
        decide(need, snap)
        times.append((time.perf_counter() - started) * 1000)
        cpu.append((time.thread_time() - cpu_started) * 1000)
    times.sort()
    cpu.sort()
    return {
        "decision": type(decision).__name__,
        # CPU time of the call alone: on a shared box the wall time's tail is time spent descheduled.
        "cpu_p50_ms": round(statistics.median(cpu), 3),
        "cpu_p99_ms": round(cpu[int(len(cpu) * 0.99) - 1], 3),
        "cpu_max_ms": round(cpu[-1], 3),
        "p50_ms": round(statistics.median(times), 3),
        "p95_ms": round(times[int(len(times) * 0.95) - 1], 3),
        "p99_ms": round(times[int(len(times) * 0.99) - 1], 3),
        "max_ms": round(times[-1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    full = snapshot(args.nodes, args.gpus, args.workers, seed=1)
    with_room = snapshot(args.nodes, args.gpus, args.workers, seed=1, leave_room_on=f"node-{args.nodes - 1:02d}")
    need = Need("new", (0, 1), 60 * G)
    named = next(
        n for node in full.nodes if isinstance(decide(n := Need("new", (0, 1), 60 * G, (node.name,)), full), MakeRoom)
    )
    cases = {
        "any node, every node full": timed(need, full, args.runs),
        "any node, the last one has room": timed(need, with_room, args.runs),
        "one named node (where room can be made)": timed(named, full, args.runs),
        # In a cluster the front door gives shares of each GPU, sized on each node's own GPUs.
        "any node, every node full, as shares of a GPU": timed(
            replace(need, gpu_bytes=None, gpu_share=0.75), as_shares(full), args.runs
        ),
    }
    result = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus,
        "workers": args.workers,
        "runs": args.runs,
        "python": platform.python_version(),
        "cases": cases,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "placement.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
