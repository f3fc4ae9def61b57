"""How fast vLLM's expert kernel reads experts in place from pinned host memory, tile by tile (a GPU check).

At batch 64 with a 25 % cache, about three quarters of a layer's experts find no slot and vLLM's
``fused_moe_kernel`` reads them in place over the link, as vLLM's own UVA offload does. That pass ran
at about 1.2x the link bound inside the engine. This check times the pass alone, the way the plugin
calls it (a UVA view of the layer's pinned experts, the cached experts skipped through an expert map),
under vLLM's own tile choice and under other tiles (``override_config``), against a plain pinned copy
of the same bytes.

    source bench/gpu/env.sh && python3 bench/gpu/in_place_configs.py --out $OUT/in_place_configs.json

Qwen3-30B-A3B's expert shape (hidden 2048, intermediate 768, 128 experts, top-8), bf16.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

H, INTER, E, TOP_K = 2048, 768, 128, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--cached", type=int, default=32, help="experts skipped as if resident in the cache")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    from vllm.model_executor.layers.fused_moe import override_config
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    from engine_patches.vllm_adapters.moe import _skip_map

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    host = []
    for shape in ((E, 2 * INTER, H), (E, H, INTER)):
        t = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
        t.copy_((torch.randn(shape, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).cpu())
        host.append(t)
    w13, w2 = (get_accelerator_view_from_cpu_tensor(t) for t in host)
    expert_bytes = (host[0][0].numel() + host[1][0].numel()) * 2
    skip_map = _skip_map(E, dev)  # the plugin's own: id E maps to -1, "not here"

    def timed(fn, repeats: int) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats

    # The link: one pinned copy of 96 experts' bytes.
    chunk = torch.empty(96 * expert_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    gpu_chunk = torch.empty_like(chunk, device=dev)
    link = 96 * expert_bytes / timed(lambda: gpu_chunk.copy_(chunk, non_blocking=True), args.repeats)
    print(f"pinned copy: {link / 1e9:.2f} GB/s")

    tiles = [None] + [
        {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": 1, "num_warps": w, "num_stages": s}
        for n, k, w, s in itertools.product((64, 128, 256), (64, 128, 256), (4, 8), (2, 3, 4, 5))
    ]
    results: dict = {"pinned_copy_gb_s": round(link / 1e9, 2), "expert_bytes": expert_bytes, "runs": []}
    for tokens in args.tokens:
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:TOP_K] for _ in range(tokens)])
        cached = torch.randperm(E, device=dev, generator=g)[: args.cached]
        skip = torch.isin(ids, cached)
        ids = ids.masked_fill(skip, E).to(torch.int32)
        read = int(torch.unique(ids[~skip]).numel())
        x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.rand(tokens, TOP_K, device=dev, generator=g).masked_fill(skip, 0.0)
        bound = read * expert_bytes / link
        for tile in tiles:

            def call() -> None:
                fused_experts(x, w13, w2, w, ids, global_num_experts=E + 1, expert_map=skip_map)

            try:
                t0 = time.perf_counter()
                with override_config(tile):
                    call()
                    torch.cuda.synchronize()
                    compile_s = time.perf_counter() - t0
                    s = timed(call, args.repeats)
            except Exception as exc:  # a tile too large for shared memory, say
                results["runs"].append({"tokens": tokens, "tile": tile, "error": f"{type(exc).__name__}"})
                continue
            row = {
                "tokens": tokens,
                "tile": tile or "vLLM's",
                "experts_read": read,
                "ms": round(s * 1e3, 3),
                "x_link_bound": round(s / bound, 3),
                "compile_s": round(compile_s, 1),
            }
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
        best = min((r for r in results["runs"] if r.get("tokens") == tokens and "ms" in r), key=lambda r: r["ms"])
        print(f"best at {tokens} tokens: {json.dumps(best)}", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
