"""GPU time of the expert cache's planner kernel per layer, by batch size (needs a CUDA GPU).

One ``DeviceSlotTables`` at the Qwen3-30B-A3B shape (128 experts, top-8) with a 25 % cache (32 slots),
the default eviction rule (use counts). For each batch size, 12 layers' plans of skewed batches (a
third of the experts take most of the choices) are captured in one CUDA graph; the graph is replayed
``--replays`` times and the median replay, divided by 12, is the figure. ``--module`` names
another module with the same ``DeviceSlotTables`` (an earlier planner kept beside this one) to time
both on the same GPU in the same run.

    python3 bench/gpu/planner_time.py --out $OUT/planner_time.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYERS, EXPERTS, SLOTS, TOP_K = 12, 128, 32, 8


def time_planner(module: str, tokens: int, replays: int) -> float:
    """Median GPU microseconds of one layer's plan of a ``tokens``-token batch."""
    tables_cls = importlib.import_module(module).DeviceSlotTables
    tables = tables_cls(LAYERS, EXPERTS, SLOTS, "cuda")
    g = torch.Generator().manual_seed(tokens)
    hot = torch.randperm(EXPERTS, generator=g)[: EXPERTS // 3]

    def batch() -> torch.Tensor:
        pool = hot if torch.rand(1, generator=g) < 0.8 else torch.arange(EXPERTS)
        return torch.stack([pool[torch.randperm(len(pool), generator=g)[:TOP_K]] for _ in range(tokens)])

    ids = [batch().to(torch.int32).cuda() for _ in range(LAYERS)]
    for layer in range(LAYERS):  # compile, and fill the tables
        tables.plan(layer, ids[layer], overflow=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            tables.plan(layer, ids[layer], overflow=True)
    times = []
    for _ in range(replays):
        for layer in range(LAYERS):
            ids[layer].copy_(batch())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 16, 32, 64])
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--module", action="append", default=["engine_patches.moe.device_slots"])
    args = parser.parse_args()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "shape": f"{EXPERTS} experts, {SLOTS} slots, top-{TOP_K}, {LAYERS} layers in one graph",
        "us_per_layer": {
            module: {str(b): round(time_planner(module, b, args.replays), 1) for b in args.batches}
            for module in args.module
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
