"""Pinned host memory of one MoE LoRA adapter: vLLM 0.32's way against the exact-size allocator.

Each variant runs in a fresh process (the caching host allocator keeps what it took, so variants
must not share one):

- ``vllm``: pin each per-expert tensor with ``.pin_memory()``, ``torch.stack`` per projection, pin
  the stacked tensor again, drop the per-expert tensors (vLLM 0.32's LoRAModel.from_lora_tensors
  + LoRAModelManager._create_merged_loras_inplace).
- ``exact_adapter``: what the plugin does inside vLLM: no first pin, stack, one exact-size pinned
  copy through ``engine_patches.pinned``.
- ``exact_direct``: stack straight into an exact-size pinned buffer (``torch.stack(out=...)``).
- ``ceiling``: one 2 GiB ``cudaHostAlloc`` buffer copied to the GPU: the bandwidth to beat.

Reports per variant: host RSS added (after the per-expert tensors are gone, and peak), pinned
bytes, the time from loaded tensors to pinned result, host-to-GPU bandwidth of the result.
Targets: exact RSS <= 1.05x the adapter bytes; bandwidth >= 95% of the ceiling.

    python bench/pinned_lora_bench.py --out results.json          # full size, needs CUDA
    python bench/pinned_lora_bench.py --tiny                      # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from lora_shapes import (  # noqa: E402
    MoEShape,
    h2d_seconds,
    load_adapter,
    malloc_trim,
    packed_groups,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)

CUDA = torch.cuda.is_available()
VARIANTS = ("vllm", "exact_adapter", "exact_direct")


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if CUDA else t  # no pinning without CUDA (smoke test)


def build_vllm_way(shape: MoEShape, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    for name in list(tensors):
        tensors[name] = _pin(tensors[name])  # from_lora_tensors: pin each
    result = []
    for _, names in packed_groups(shape):
        stacked = torch.stack([tensors.pop(n) for n in names])  # pack_moe
        result.append(_pin(stacked))  # _create_merged_loras_inplace: pin again
    result.extend(_pin(t) for t in tensors.values())  # attention tensors: already pinned
    tensors.clear()
    return result


def build_exact_adapter(shape: MoEShape, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    from engine_patches.pinned import default_allocator

    alloc = default_allocator()
    result = []
    for _, names in packed_groups(shape):
        stacked = torch.stack([tensors.pop(n) for n in names])
        result.append(alloc.pin(stacked))
        del stacked
    result.extend(alloc.pin(t) for t in tensors.values())
    tensors.clear()
    return result


def build_exact_direct(shape: MoEShape, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    from engine_patches.pinned import default_allocator

    alloc = default_allocator()
    result = []
    for _, names in packed_groups(shape):
        first = tensors[names[0]]
        out = alloc.empty((len(names), *first.shape), first.dtype)
        torch.stack([tensors.pop(n) for n in names], out=out)
        result.append(out)
    result.extend(alloc.pin(t) for t in tensors.values())
    tensors.clear()
    return result


def h2d_gbps(tensors: list[torch.Tensor], repeats: int = 5) -> float | None:
    """Host-to-GPU bandwidth copying every tensor once (median of ``repeats``)."""
    seconds = h2d_seconds(tensors, repeats)
    if seconds is None:
        return None
    return sum(t.numel() * t.element_size() for t in tensors) / seconds / 1e9


def host_allocator_stats() -> dict[str, int]:
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:
        return {}
    return {k: int(v) for k, v in stats.items() if "bytes" in k and k.endswith("current")}


def run_variant(variant: str, shape: MoEShape) -> dict:
    if CUDA:
        torch.cuda.init()
        torch.empty(1, device="cuda")  # context up before the baseline
    tensors = load_adapter(shape)
    adapter_bytes = shape.adapter_bytes()
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == adapter_bytes
    malloc_trim()
    rss_loaded = rss_bytes()
    reset_peak_rss()
    build = {"vllm": build_vllm_way, "exact_adapter": build_exact_adapter, "exact_direct": build_exact_direct}[variant]
    t0 = time.perf_counter()
    result = build(shape, tensors)
    elapsed = time.perf_counter() - t0
    peak = peak_rss_bytes()
    malloc_trim()
    rss_after = rss_bytes()
    result_bytes = sum(t.numel() * t.element_size() for t in result)
    # RSS held for the result: the loaded tensors were adapter_bytes of the baseline and are
    # gone now, so add them back.
    held = rss_after - rss_loaded + adapter_bytes
    out = {
        "variant": variant,
        "adapter_bytes": adapter_bytes,
        "result_bytes": result_bytes,
        "rss_held_bytes": held,
        "rss_held_ratio": held / adapter_bytes,
        "peak_rss_added_bytes": peak - rss_loaded + adapter_bytes,
        "build_s": elapsed,
        "tensors": len(result),
        "all_pinned": bool(CUDA and all(t.is_pinned() for t in result)),
        "h2d_gbps": h2d_gbps(result),
        # the stacked expert tensors alone (a few MB each; the 64 KiB attention tensors pay
        # a per-copy overhead that no allocator removes)
        "h2d_gbps_packed": h2d_gbps(result[: len(packed_groups(shape))]),
    }
    if variant == "vllm":
        out["caching_host_allocator"] = host_allocator_stats()
    else:
        from engine_patches.pinned import default_allocator

        out["allocator"] = default_allocator().stats().as_dict()
    return out


def run_ceiling(nbytes: int) -> dict:
    if not CUDA:
        return {"variant": "ceiling", "h2d_gbps": None}
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buf.fill_(1)
    return {"variant": "ceiling", "bytes": nbytes, "h2d_gbps": h2d_gbps([buf])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    parser.add_argument("--variant", choices=(*VARIANTS, "ceiling"), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help="override the number of layers")
    parser.add_argument("--out", type=Path, help="write the results JSON here")
    args = parser.parse_args()
    shape = MoEShape.tiny() if args.tiny else MoEShape()
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)

    if args.variant:  # child process: one variant, JSON on the last stdout line
        doc = (
            run_ceiling(64 << 20 if args.tiny else 2 << 30)
            if args.variant == "ceiling"
            else run_variant(args.variant, shape)
        )
        print(json.dumps(doc))
        return

    results = {
        "shape": {k: str(v) for k, v in vars(shape).items()},
        "cuda": CUDA,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
    }
    runs: list[dict[str, Any]] = []
    for variant in ("ceiling", *VARIANTS):
        cmd = [sys.executable, __file__, "--variant", variant] + (["--tiny"] if args.tiny else [])
        cmd += ["--layers", str(shape.layers)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if proc.returncode != 0:
            runs.append({"variant": variant, "error": proc.stderr[-2000:]})
            continue
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    results["runs"] = runs
    ceiling = next((r.get("h2d_gbps") for r in runs if r["variant"] == "ceiling"), None)
    for r in runs:
        if ceiling and r.get("h2d_gbps"):
            r["h2d_vs_ceiling"] = r["h2d_gbps"] / ceiling
            if r.get("h2d_gbps_packed"):
                r["h2d_packed_vs_ceiling"] = r["h2d_gbps_packed"] / ceiling
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    for r in runs:
        if "error" in r:
            print(f"{r['variant']}: FAILED\n{r['error']}", file=sys.stderr)
        elif r["variant"] != "ceiling":
            gbps = f"{r['h2d_gbps']:.1f} GB/s" if r["h2d_gbps"] else "n/a"
            print(
                f"{r['variant']:>14}: RSS held {r['rss_held_ratio']:.3f}x of "
                f"{r['adapter_bytes'] / 1e9:.2f} GB, peak +{r['peak_rss_added_bytes'] / 1e9:.2f} GB, "
                f"build {r['build_s']:.2f} s, h2d {gbps}",
                file=sys.stderr,
            )
    if any("error" in r for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
