"""Benchmark: one MoE layer's pieces at batch 1, each timed alone (where a decode step's time goes).

Qwen3-30B-A3B shapes (E experts per layer in pinned host memory, top-8, hidden 2048,
moe_intermediate 768, bf16). Every figure is a CUDA-graph replay of the piece over L different
layers (their own cache slots and their own host experts, so no layer's bytes are still in L2),
median of 5 replays, divided by L:

- ``plan``: the device slot planner (one small kernel);
- ``gather m``: the Triton gather of m missing experts from host memory into slots;
- ``experts``: the expert math of 8 resident entries (gate/up kernel + down-and-sum kernel);
- ``gather m + experts``: the gather path of run 5 (one layer's copy, then its math);
- ``fetch m``: the expert kernels reading m of the 8 experts from host memory themselves;
- ``down``: the down-and-sum kernel alone;
- ``fetch m (rows, columns, warps, split)``: the fetch kernel's launch shapes.

For the pieces that read host memory: GB/s of expert bytes, and the time over the link bound
(bytes / the pinned DMA rate measured here).

    python3 bench/moe_layer_parts.py --out $OUT/moe_layer_parts.json    # needs a GPU, ~10 GB RAM
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_patches.moe import fetch_experts
from engine_patches.moe.device_slots import DeviceSlotTables
from engine_patches.moe.experts_triton import down_and_sum, gemv_experts
from engine_patches.moe.fetch_experts import fetch_and_compute
from engine_patches.moe.gather import copy_expert_pairs_indexed
from engine_patches.pinned import empty_pinned


def replay_seconds(fn, layers: int) -> float:
    """Median seconds of one ``fn(layer)`` when all layers run in one CUDA graph."""
    for layer in range(layers):  # compile and warm up outside the capture
        fn(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del graph
    return statistics.median(times[1:]) / layers


# Launch shapes of the fetch kernel: (rows, hidden columns, warps, w2 in programs of its own)
# (the first is the shipped default)
FETCH_CONFIGS = [
    (16, 512, 4, False),
    (16, 256, 4, False),
    (16, 256, 4, True),
    (8, 256, 4, True),
    (16, 512, 8, True),
    (32, 256, 8, True),
    (8, 512, 4, True),
]


def use_fetch_config(cfg) -> None:
    """Make ``fetch_and_compute`` launch with ``cfg`` from now on (it reads these per call)."""
    (fetch_experts.BLOCK_ROWS, fetch_experts.BLOCK_H, fetch_experts.NUM_WARPS, fetch_experts.SPLIT_W2) = cfg


def fetch_sweep(host, slots, x, w, ids, configs, ms=(2,)):
    """Seconds per layer of ``fetch_and_compute`` with m of 8 experts loading, per config.

    ``host``/``slots``: per layer (w13, w2) in host memory / GPU slots (at least top-k slots);
    ``ids``: per layer [1, k] expert ids. Returns {(cfg, m): seconds or an error string}."""
    k = ids[0].shape[1]
    dev = x.device
    slot_ids = torch.arange(k, dtype=torch.int32, device=dev).view(1, k)
    out = {}
    for cfg in configs:
        use_fetch_config(cfg)
        for m in ms:
            lm = torch.where(torch.arange(k, device=dev) < m, slot_ids[0], -1).view(1, k).int()
            try:
                out[(cfg, m)] = replay_seconds(
                    lambda l: fetch_and_compute(x, slots[l], host[l], w, ids[l], slot_ids, lm), len(host)
                )
            except Exception as exc:  # report, go on with the others
                out[(cfg, m)] = f"failed: {exc!r}"[:200]
    use_fetch_config(FETCH_CONFIGS[0])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    L, E, H, I, K = a.layers, a.experts, a.hidden, a.inter, a.top_k
    bf = torch.bfloat16

    host, slots = [], []
    for _ in range(L):
        w13 = empty_pinned((E, 2 * I, H), bf)
        w2 = empty_pinned((E, H, I), bf)
        w13.copy_((torch.randn(E, 2 * I, H, device=dev, generator=g) / H**0.5).to(bf))
        w2.copy_((torch.randn(E, H, I, device=dev, generator=g) / I**0.5).to(bf))
        host.append((w13, w2))
        slots.append(
            (
                torch.randn(K, 2 * I, H, device=dev, generator=g).to(bf) / H**0.5,
                torch.randn(K, H, I, device=dev, generator=g).to(bf) / I**0.5,
            )
        )
    expert_bytes = (2 * I * H + H * I) * 2
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst.copy_(src)
    torch.cuda.synchronize()
    a0, b0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a0.record()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    b0.record()
    b0.synchronize()
    link = 4 * (1 << 30) / (a0.elapsed_time(b0) / 1e3)

    x = torch.randn(1, H, device=dev, generator=g).to(bf)
    w = torch.softmax(torch.randn(1, K, device=dev, generator=g), -1)
    slot_ids = torch.arange(K, dtype=torch.int32, device=dev).view(1, K)
    ids = [torch.randperm(E, device=dev, generator=g)[:K].view(1, K) for _ in range(L)]
    act = torch.randn(K, I, device=dev, generator=g)

    def loads(m):  # the first m entries are being loaded into their slots
        return torch.where(torch.arange(K, device=dev) < m, slot_ids[0], -1).view(1, K).int()

    rows, res = [], {"link_GBps": link / 1e9, "args": vars(a) | {"out": str(a.out)}}

    def add(name, sec, m=0):
        row = {"part": name, "us_per_layer": sec * 1e6}
        if m:
            row["GBps"] = m * expert_bytes / sec / 1e9
            row["x_link_bound"] = sec / (m * expert_bytes / link)
        rows.append(row)
        extra = f"  {row['GBps']:5.1f} GB/s  x{row['x_link_bound']:.3f} link bound" if m else ""
        print(f"{name:24s}{sec * 1e6:9.1f} us/layer{extra}", flush=True)

    tables = DeviceSlotTables(L, E, 32, dev)
    add("plan", replay_seconds(lambda l: tables.plan(l, ids[l]), L))
    add("experts (8 resident)", replay_seconds(lambda l: gemv_experts(x, slots[l][0], slots[l][1], w, slot_ids), L))
    add("down", replay_seconds(lambda l: down_and_sum(act, slots[l][1], slot_ids, w, bf), L))
    for m in (1, 2, 4):
        lm = loads(m)
        exp = [ids[l][0, :].int() for l in range(L)]
        ld_e = [torch.where(lm[0] >= 0, exp[l], -1).int() for l in range(L)]
        ld_s = lm[0].int()

        def gather(l):
            copy_expert_pairs_indexed(host[l], slots[l], ld_e[l], ld_s)

        add(f"gather {m}", replay_seconds(gather, L), m)

        def gather_then_math(l):
            gather(l)
            gemv_experts(x, slots[l][0], slots[l][1], w, slot_ids)

        add(f"gather {m} + experts", replay_seconds(gather_then_math, L), m)
        add(
            f"fetch {m}",
            replay_seconds(lambda l: fetch_and_compute(x, slots[l], host[l], w, ids[l], slot_ids, lm), L),
            m,
        )
    sweep = fetch_sweep(host, slots, x, w, ids, FETCH_CONFIGS, (1, 2))
    res["fetch_configs"] = []
    for (cfg, m), sec in sweep.items():
        if isinstance(sec, float):
            res["fetch_configs"].append(
                {"rows_h_warps_split": cfg, "m": m, "us": sec * 1e6, "GBps": m * expert_bytes / sec / 1e9}
            )
            print(f"fetch {m} {cfg}: {sec * 1e6:8.1f} us  {m * expert_bytes / sec / 1e9:5.1f} GB/s", flush=True)
        else:
            print(f"fetch {m} {cfg}: {sec}", flush=True)
    # Same numbers both ways: the fetched slots hold the host experts, the outputs agree.
    lm = loads(2)
    got = fetch_and_compute(x, slots[0], host[0], w, ids[0], slot_ids, lm)
    ref = gemv_experts(x, slots[0][0], slots[0][1], w, slot_ids)
    e0 = int(ids[0][0, 0])
    res["fetch_check"] = {
        "slot_equals_host": bool(
            torch.equal(slots[0][0][0].cpu(), host[0][0][e0]) and torch.equal(slots[0][1][0].cpu(), host[0][1][e0])
        ),
        "rel_err_vs_resident_math": float((got.float() - ref.float()).norm() / ref.float().norm()),
    }
    print("check:", res["fetch_check"], f"link {link / 1e9:.1f} GB/s", flush=True)
    res["rows"] = rows
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
