"""N MoE LoRA adapters in host memory: vLLM 0.32's way against the CPU LoRA pool.

Each variant runs in a fresh process:
- ``vllm``: per adapter, read every tensor (one pageable tensor each, as safetensors gives
  them), pin each, stack the experts per projection, pin again (LoRAModel.from_lora_tensors +
  LoRAModelManager._create_merged_loras_inplace); all N stay resident (max_cpu_loras >= N).
- ``pool``: a CPULoRAPool of N adapters' bytes; each tensor is read straight into its slot, the
  experts into their final stacked layout.

Reports: peak host RSS added over the adapters' bytes (targets: <= 1.1x, and >= 40% below vLLM's
way), load time per adapter, and the host-to-GPU time of one adapter swap against its bytes over
the pinned ceiling measured in the same process.

    python bench/lora_pool_bench.py --adapters 4 --out results.json    # full size, needs CUDA
    python bench/lora_pool_bench.py --tiny                             # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from lora_shapes import MoEShape, h2d_seconds, load_adapter, malloc_trim, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402
from pinned_lora_bench import build_vllm_way  # noqa: E402

CUDA = torch.cuda.is_available()


def pool_modules(shape: MoEShape) -> dict[str, tuple]:
    """Module name -> ((A shape, dtype), (B shape, dtype)), experts already stacked."""
    d, e = shape.dtype, shape.experts
    ex, at = shape.expert_tensors(), shape.attention_tensors()
    mods = {}
    for layer in range(shape.layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            mods[f"layers.{layer}.mlp.experts.{proj}"] = (
                ((e, *ex[f"{proj}.lora_A"]), d),
                ((e, *ex[f"{proj}.lora_B"]), d),
            )
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            mods[f"layers.{layer}.self_attn.{proj}"] = ((at[f"{proj}.lora_A"], d), (at[f"{proj}.lora_B"], d))
    return mods


def fill_from_checkpoint(seed: int):
    """Stand-in for reading the safetensors file into the slots: expert by expert, in place."""
    value = float(seed % 7 + 1) / 8

    def fill(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if ".experts." in name:
            for expert in range(a.shape[0]):
                a[expert].fill_(value)
                b[expert].fill_(value)
        else:
            a.fill_(value)
            b.fill_(value)

    return fill


def gpu_swap_s(tensors: list[torch.Tensor], repeats: int = 5) -> float | None:
    return h2d_seconds(tensors, repeats)


def pinned_ceiling_gbps(nbytes: int) -> float | None:
    if not CUDA:
        return None
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    seconds = gpu_swap_s([buf])
    return nbytes / seconds / 1e9 if seconds else None


def run_variant(variant: str, shape: MoEShape, n: int) -> dict:
    if CUDA:
        torch.empty(1, device="cuda")  # context up before the baseline
    adapter_bytes = shape.adapter_bytes()
    malloc_trim()
    base = rss_bytes()
    reset_peak_rss()
    resident: list[list[torch.Tensor]] = []
    load_times = []
    pool = None
    if variant == "pool":
        from engine_patches.lora_pool import CPULoRAPool

        pool = CPULoRAPool(n * adapter_bytes)
        mods = pool_modules(shape)
    for i in range(n):
        t0 = time.perf_counter()
        if pool is None:
            resident.append(build_vllm_way(shape, load_adapter(shape, seed=i)))
        else:
            adapter = pool.load(i, mods, fill_from_checkpoint(i))
            resident.append([t for layer in adapter.layers.values() for t in (layer.lora_a, layer.lora_b)])
        load_times.append(time.perf_counter() - t0)
    peak = peak_rss_bytes() - base
    malloc_trim()
    held = rss_bytes() - base
    total = n * adapter_bytes
    swap = gpu_swap_s(resident[-1])
    ceiling = pinned_ceiling_gbps(2 << 30 if not shape.layers < 4 else 64 << 20)
    out = {
        "variant": variant,
        "adapters": n,
        "adapter_bytes": adapter_bytes,
        "peak_rss_added_bytes": peak,
        "peak_ratio": peak / total,
        "held_rss_added_bytes": held,
        "held_ratio": held / total,
        "load_s_per_adapter": statistics.mean(load_times),
        "load_s": load_times,
        "all_pinned": bool(CUDA and all(t.is_pinned() for t in resident[-1])),
        "swap_s": swap,
        "ceiling_gbps": ceiling,
        "swap_ideal_s": adapter_bytes / (ceiling * 1e9) if ceiling else None,
    }
    if swap and ceiling:
        out["swap_vs_ideal"] = out["swap_ideal_s"] / swap
    if pool is not None:
        out["pool"] = pool.stats().as_dict()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--variant", choices=("vllm", "pool"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shape = MoEShape.tiny() if args.tiny else MoEShape()
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    if args.variant:
        print(json.dumps(run_variant(args.variant, shape, args.adapters)))
        return
    runs: list[dict[str, Any]] = []
    for variant in ("vllm", "pool"):
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            "--adapters",
            str(args.adapters),
            "--layers",
            str(shape.layers),
        ] + (["--tiny"] if args.tiny else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            runs.append({"variant": variant, "error": proc.stderr[-2000:]})
        else:
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    doc = {"shape": {k: str(v) for k, v in vars(shape).items()}, "cuda": CUDA, "runs": runs}
    by = {r["variant"]: r for r in runs if "error" not in r}
    if "vllm" in by and "pool" in by:
        doc["peak_saving_vs_vllm"] = 1 - by["pool"]["peak_rss_added_bytes"] / max(by["vllm"]["peak_rss_added_bytes"], 1)
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    for r in runs:
        if "error" in r:
            print(f"{r['variant']}: FAILED\n{r['error']}", file=sys.stderr)
            continue
        swap = f"{r['swap_s'] * 1e3:.1f} ms ({r.get('swap_vs_ideal', 0):.0%} of ideal)" if r["swap_s"] else "n/a"
        print(
            f"{r['variant']:>5}: peak +{r['peak_ratio']:.2f}x, held {r['held_ratio']:.2f}x of "
            f"{r['adapters']} x {r['adapter_bytes'] / 1e9:.2f} GB, load "
            f"{r['load_s_per_adapter']:.2f} s/adapter, swap {swap}",
            file=sys.stderr,
        )
    if "peak_saving_vs_vllm" in doc:
        print(f"pool peak RSS is {doc['peak_saving_vs_vllm']:.0%} below vLLM's way", file=sys.stderr)
    sys.exit(1 if any("error" in r for r in runs) else 0)


if __name__ == "__main__":
    main()
