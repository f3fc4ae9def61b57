"""How often the GPU expert cache hits under other eviction rules: a CPU simulation, no GPU, no vLLM.

The cache evicts the least recently used expert (``engine_patches.moe.device_slots``). This replays the
routing stand-in's traces (``engine_patches.moe.routing_standin``: Zipf popularity per layer, each row
keeping each expert of its previous step with probability 0.5) through three rules for one layer's
slots, one decode step at a time:

- ``lru``: the cache's rule now (the experts one batch uses share one tick);
- ``lfu_decay_D``: evict the expert with the lowest use count, every count multiplied by D each step
  (D near 1: long memory of popularity; small D: close to LRU);
- ``belady``: evict the expert used again furthest in the future. It knows the future, so no cache can
  do better: the bound for any rule.

An expert the batch uses is evicted for the same batch only when the batch needs more experts than
there are slots (then the cache keeps what the rule ranks highest of them). Misses cross the link, so at batch 1
the step's copy time goes with 1 - hit rate (bench/README.md, "How often the cache hits under other
eviction rules").

    python3 bench/moe_cache_policy.py --out bench/results/moe_cache_policy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine_patches.moe.routing_standin import ZipfReuseRouting

Rule = Callable[[list[list[int]], int, int], float]


def trace(batch: int, steps: int, experts: int, top_k: int, seed: int) -> list[list[int]]:
    """The distinct experts of each decode step of one layer."""
    routing = ZipfReuseRouting(experts, top_k, layer=0, seed=seed)
    return [sorted(set(routing.route(batch, "cpu")[1].flatten().tolist())) for _ in range(steps)]


def lru(steps: list[list[int]], slots: int, experts: int) -> float:
    last: dict[int, int] = {}
    hits = total = 0
    for tick, used in enumerate(steps):
        total += len(used)
        hits += sum(e in last for e in used)
        for e in used:
            last[e] = tick
        while len(last) > slots:
            old = [(t, e) for e, t in last.items() if t != tick] or [(t, e) for e, t in last.items()]
            del last[min(old)[1]]
    return hits / total


def lfu_decay(decay: float) -> Rule:
    def rule(steps: list[list[int]], slots: int, experts: int) -> float:
        score = [0.0] * experts
        cache: set[int] = set()
        hits = total = 0
        for used in steps:
            score = [s * decay for s in score]
            total += len(used)
            hits += sum(e in cache for e in used)
            for e in used:
                score[e] += 1.0
            cache |= set(used)
            while len(cache) > slots:
                pick = [e for e in cache if e not in used] or list(cache)
                cache.discard(min((score[e], e) for e in pick)[1])
        return hits / total

    return rule


def belady(steps: list[list[int]], slots: int, experts: int) -> float:
    never = len(steps)
    next_use: list[dict[int, int]] = [{} for _ in steps]
    seen: dict[int, int] = {}
    for i in range(len(steps) - 1, -1, -1):
        next_use[i] = dict(seen)
        for e in steps[i]:
            seen[e] = i
    cache: set[int] = set()
    hits = total = 0
    for i, used in enumerate(steps):
        total += len(used)
        hits += sum(e in cache for e in used)
        cache |= set(used)
        while len(cache) > slots:
            pick = [e for e in cache if e not in used] or list(cache)
            cache.discard(max((next_use[i].get(e, never), e) for e in pick)[1])
    return hits / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="a JSON of the hit rates")
    parser.add_argument("--steps", type=int, default=4000, help="decode steps per trace (at most 100000)")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--slots", type=int, nargs="*", default=[12, 32], help="of 128 experts: 10 and 25 %%")
    parser.add_argument("--decays", type=float, nargs="*", default=[0.999, 0.99, 0.95, 0.8])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="one trace (one layer) each")
    args = parser.parse_args()
    if not 1 <= args.steps <= 100_000:
        parser.error("--steps must be in 1..100000")
    torch.manual_seed(0)
    rules: dict[str, Rule] = {"lru": lru, **{f"lfu_decay_{d:g}": lfu_decay(d) for d in args.decays}, "belady": belady}
    rows = []
    for batch in args.batches:
        traces = [trace(batch, args.steps, 128, 8, seed) for seed in args.seeds]
        for slots in args.slots:
            row: dict[str, object] = {"batch": batch, "slots": slots}
            for name, rule in rules.items():
                row[name] = round(sum(rule(t, slots, 128) for t in traces) / len(traces), 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"steps": args.steps, "seeds": args.seeds, "hit_rates": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
