"""Benchmark: does fetching the next layer's experts ahead hide the link behind the rest of a step?

A decode step at batch 1 through L MoE layers of the Qwen3-30B-A3B shape (128 experts, top-8,
hidden 2048, moe_intermediate 768, bf16, in pinned host memory; a GPU cache of ``--cache`` of
them per layer), routed by the benchmark stand-in (Zipf + reuse), the whole step one CUDA graph,
as vLLM's full decode graphs run it. Between two MoE layers, ``torch.cuda._sleep`` holds the
compute stream for ``--busy-us`` microseconds on one SM: the stand-in for attention, norms and the
router, which at batch 1 leave the link idle and most SMs free.

Per case (no fetching ahead; fetching ahead on a guess right ``accuracy`` of the time): the step
time (median of the replays), the bytes over the link per step from the cache's own counters, and
the step time over the link bound (those bytes at the pinned host-to-GPU rate measured here).
If fetching ahead hides the link, a step tends to max(link, busy) instead of their sum.

    python3 bench/moe_fetch_ahead.py --out $OUT/moe_fetch_ahead.json    # needs a GPU, ~16 GB of RAM
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_patches.moe.offload import ExpertOffload
from engine_patches.moe.routing_standin import ZipfReuseRouting
from engine_patches.moe.store import ExpertStore
from engine_patches.pinned import empty_pinned

E, K, H, INTER = 128, 8, 2048, 768


def pinned_rate() -> float:
    n = 1 << 30
    host, dev = torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dev.copy_(host, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return n / statistics.median(times[1:]) / 1e9


def sleep_cycles_per_us() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per microsecond, measured."""
    cycles = 20_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return cycles / (a.elapsed_time(b) * 1e3)


def build_step(store, layers, slots, busy_cycles, accuracy, seed, **offload_kw):
    """The offload and one captured decode step (warm: compiled, the cache filled)."""
    off = ExpertOffload(store, device="cuda", slots_per_layer=slots, planner="device", **offload_kw)
    routes = [ZipfReuseRouting(E, K, layer=i, seed=seed) for i in range(layers)]
    x = torch.randn(1, H, device="cuda").bfloat16()
    w = torch.full((1, K), 1.0 / K, device="cuda")

    def step():
        y = x
        for layer in range(layers):
            if busy_cycles:
                torch.cuda._sleep(busy_cycles)
            _, ids = routes[layer].route(1, "cuda")
            guess = None
            if accuracy is not None and layer + 1 < layers:
                nxt = routes[layer + 1]
                guess = lambda _x, r=nxt: r.draw_ahead(1, "cuda", accuracy)  # noqa: E731
            y = off.forward(layer, x, w, ids, guess_next=guess)
        return y

    for _ in range(3):  # compile and fill the cache outside the capture
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):  # steady state
        graph.replay()
    torch.cuda.synchronize()
    return off, graph


def run_case(store, layers, slots, busy_cycles, accuracy, replays, seed, **offload_kw) -> dict:
    off, graph = build_step(store, layers, slots, busy_cycles, accuracy, seed, **offload_kw)
    before = off.stats()
    times = replay_ms(graph, replays)
    after = off.stats()
    moved = (after.bytes_moved + after.streamed_bytes) - (before.bytes_moved + before.streamed_bytes)
    used, wasted = after.ahead_used - before.ahead_used, after.ahead_wasted - before.ahead_wasted
    return {
        "step_ms": round(statistics.median(times), 3),
        "bytes_per_step": moved / replays,
        "hit_rate": round(
            (after.hits - before.hits) / max(1, (after.hits + after.misses) - (before.hits + before.misses)), 4
        ),
        "guess_hit_rate": round(used / (used + wasted), 4) if used + wasted else None,
    }


def trace_case(store, layers, slots, busy_cycles, accuracy, seed, path: Path, **offload_kw) -> dict:
    """One replay under the profiler: each kernel's stream, start and length, and how much of the
    gathers ran beside a kernel of another stream (the overlap fetching ahead is for)."""
    from torch.profiler import ProfilerActivity, profile

    _, graph = build_step(store, layers, slots, busy_cycles, accuracy, seed, **offload_kw)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return {"error": "the profiler saw no kernels"}
    t0 = kernels[0]["ts"]
    rows = [
        (e["args"].get("stream"), e["name"].split("(")[0][:40], round(e["ts"] - t0, 1), round(e["dur"], 1))
        for e in kernels
    ]
    streams = sorted({r[0] for r in rows}, key=str)
    per_stream = {}
    for s in streams:
        mine = [r for r in rows if r[0] == s]
        per_stream[str(s)] = {"kernels": len(mine), "busy_us": round(sum(r[3] for r in mine), 1)}
    gathers = [r for r in rows if "gather" in r[1]]
    others = [r for r in rows if "gather" not in r[1]]
    beside = 0.0
    for g in gathers:
        g0, g1 = g[2], g[2] + g[3]
        spans = sorted((max(g0, o[2]), min(g1, o[2] + o[3])) for o in others if o[0] != g[0])
        end = g0
        for a, b in spans:  # union of the other streams' kernels inside this gather
            a = max(a, end)
            if b > a:
                beside += b - a
                end = b
    return {
        "step_us": round(max(r[2] + r[3] for r in rows), 1),
        "streams": per_stream,
        "gather_us": round(sum(g[3] for g in gathers), 1),
        "gather_beside_other_streams_us": round(beside, 1),
        "timeline": rows,
    }


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """Milliseconds of each of ``replays`` replays of ``graph``, one at a time."""
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def graph_ms(fn, replays: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return statistics.median(replay_ms(graph, replays)[2:])


def side_stream_probe(
    store, per_us: float, programs: int, busy_us: float = 300.0, experts: int = 2, neighbour: str = "sleep"
) -> dict:
    """Whether a gather on a side stream runs beside the compute stream inside one CUDA graph:
    the gather alone, the busy kernel alone, and both forked and joined (max of the two if they
    overlap, their sum if not). ``neighbour``: the busy kernel, ``sleep`` (one SM spinning) or
    ``hbm`` (a copy within GPU memory on every SM, as the model's own kernels read their weights)."""
    from engine_patches.moe.gather import copy_expert_pairs_indexed

    lay = store.layers[0]
    slots = (
        torch.empty((8, *lay.w13.shape[1:]), dtype=lay.w13.dtype, device="cuda"),
        torch.empty((8, *lay.w2.shape[1:]), dtype=lay.w2.dtype, device="cuda"),
    )
    ids = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    ids[:experts] = torch.arange(experts, dtype=torch.int32)
    side = torch.cuda.Stream()
    cycles = int(busy_us * per_us)
    if neighbour == "hbm":
        a = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)

        def busy():
            b.copy_(a)
    else:

        def busy():
            torch.cuda._sleep(cycles)

    def gather():
        copy_expert_pairs_indexed((lay.w13, lay.w2), slots, ids, ids, programs=programs)

    def both():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            gather()
        busy()
        main.wait_stream(side)

    return {
        "gather_ms": round(graph_ms(gather), 3),
        "busy_ms": round(graph_ms(busy), 3),
        "both_ms": round(graph_ms(both), 3),
        "experts": experts,
        "programs": programs,
        "neighbour": neighbour,
    }


def ahead_kw(priority: int, programs: int | None) -> dict:
    """The offload's fetch-ahead keywords of a case (no grid: the library's default, for the case
    that fetches nothing ahead)."""
    return {"ahead_priority": priority, **({"ahead_programs": programs} if programs else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/moe_fetch_ahead.json"))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--cache", type=float, default=0.25, help="share of each layer's experts the GPU holds")
    ap.add_argument("--busy-us", type=float, nargs="*", default=[0, 60, 130])
    ap.add_argument("--accuracies", type=float, nargs="*", default=[1.0, 0.8])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument(
        "--probe-programs", type=int, nargs="*", default=[0, 33, 66, 132, 264], help="gather grids to probe (0: widest)"
    )
    ap.add_argument(
        "--ahead-priorities", type=int, nargs="*", default=[0], help="stream priorities of the fetch ahead (-1: high)"
    )
    ap.add_argument(
        "--ahead-programs", type=int, nargs="*", default=[24], help="gather grids of the fetch ahead (24: the default)"
    )
    ap.add_argument("--probe-neighbours", nargs="*", default=["sleep"], choices=["sleep", "hbm"])
    ap.add_argument("--trace-busy-us", type=float, nargs="*", default=[], help="trace one replay at these busy times")
    args = ap.parse_args(argv)
    rate = pinned_rate()
    per_us = sleep_cycles_per_us()
    store = ExpertStore(allocator=empty_pinned)
    for _ in range(args.layers):
        store.add_layer(
            torch.empty(E, 2 * INTER, H, dtype=torch.bfloat16), torch.empty(E, H, INTER, dtype=torch.bfloat16)
        )
    slots = max(K, round(args.cache * E))
    result = {
        "gpu": torch.cuda.get_device_name(),
        "pinned_gbps": round(rate, 2),
        "layers": args.layers,
        "slots": slots,
        "cases": [],
    }
    print(f"{result['gpu']}: pinned {rate:.2f} GB/s, {args.layers} layers, {slots} of {E} experts cached", flush=True)
    result["side_stream_probe"] = [
        side_stream_probe(store, per_us, n, neighbour=nb) for nb in args.probe_neighbours for n in args.probe_programs
    ]
    for probe in result["side_stream_probe"]:
        print(json.dumps(probe), flush=True)
    result["traces"] = []
    for busy in args.trace_busy_us:
        variants = [(1.0, p, n) for p in args.ahead_priorities for n in args.ahead_programs]
        for accuracy, prio, programs in [(None, 0, None), *variants]:
            path = args.out.with_name(f"trace_{int(busy)}_{accuracy}_{prio}_{programs}.json")
            t = trace_case(
                store,
                args.layers,
                slots,
                int(busy * per_us),
                accuracy,
                1,
                path,
                **ahead_kw(prio, programs),
            )
            t.update(busy_us=busy, accuracy=accuracy, ahead_priority=prio, ahead_programs=programs)
            result["traces"].append(t)
            print(json.dumps({k: v for k, v in t.items() if k != "timeline"}), flush=True)
    for busy in args.busy_us:
        variants = [(a, p, n) for a in args.accuracies for p in args.ahead_priorities for n in args.ahead_programs]
        for accuracy, prio, programs in [(None, 0, None), *variants]:
            r = run_case(
                store,
                args.layers,
                slots,
                int(busy * per_us),
                accuracy,
                args.replays,
                seed=1,
                **ahead_kw(prio, programs),
            )
            bound_ms = r["bytes_per_step"] / (rate * 1e9) * 1e3
            r.update(
                busy_us=busy,
                accuracy=accuracy,
                ahead_priority=prio,
                ahead_programs=programs,
                link_ms=round(bound_ms, 3),
            )
            r["x_link"] = round(r["step_ms"] / bound_ms, 3) if bound_ms else None
            r["x_link_plus_busy"] = round(r["step_ms"] / (bound_ms + busy * args.layers / 1e3), 3)
            result["cases"].append(r)
            print(json.dumps(r), flush=True)
            args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
