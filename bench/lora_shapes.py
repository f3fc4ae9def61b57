"""Shapes of a rank-16 LoRA adapter on a Qwen3-30B-A3B-shaped MoE model, and vLLM 0.32's way of
turning it into pinned host tensors. Shared by the pinned-memory and LoRA-pool benchmarks.

Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts, moe_intermediate 768, 32 query heads and
4 KV heads of 128. The adapter covers every expert's gate/up/down and the attention projections.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import statistics
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEShape:
    layers: int = 48
    hidden: int = 2048
    experts: int = 128
    moe_inter: int = 768
    q_dim: int = 4096
    kv_dim: int = 512
    rank: int = 16
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def tiny(cls) -> MoEShape:
        return cls(layers=2, hidden=64, experts=4, moe_inter=32, q_dim=64, kv_dim=32, rank=4)

    def expert_tensors(self) -> dict[str, tuple[int, ...]]:
        """Per-expert LoRA tensor shapes, as a PEFT checkpoint stores them."""
        r, h, i = self.rank, self.hidden, self.moe_inter
        return {
            "gate_proj.lora_A": (r, h),
            "gate_proj.lora_B": (i, r),
            "up_proj.lora_A": (r, h),
            "up_proj.lora_B": (i, r),
            "down_proj.lora_A": (r, i),
            "down_proj.lora_B": (h, r),
        }

    def attention_tensors(self) -> dict[str, tuple[int, ...]]:
        r, h = self.rank, self.hidden
        return {
            "q_proj.lora_A": (r, h),
            "q_proj.lora_B": (self.q_dim, r),
            "k_proj.lora_A": (r, h),
            "k_proj.lora_B": (self.kv_dim, r),
            "v_proj.lora_A": (r, h),
            "v_proj.lora_B": (self.kv_dim, r),
            "o_proj.lora_A": (r, self.q_dim),
            "o_proj.lora_B": (h, r),
        }

    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def adapter_bytes(self) -> int:
        per_layer = self.experts * sum(math.prod(s) for s in self.expert_tensors().values())
        per_layer += sum(math.prod(s) for s in self.attention_tensors().values())
        return self.layers * per_layer * self.itemsize()


def load_adapter(shape: MoEShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors as safetensors hands them over: one pageable CPU tensor per name."""
    tensors = {}
    value = float(seed % 7 + 1) / 8
    for layer in range(shape.layers):
        for name, dims in shape.attention_tensors().items():
            tensors[f"layers.{layer}.self_attn.{name}"] = torch.full(dims, value, dtype=shape.dtype)
        for expert in range(shape.experts):
            for name, dims in shape.expert_tensors().items():
                tensors[f"layers.{layer}.mlp.experts.{expert}.{name}"] = torch.full(dims, value, dtype=shape.dtype)
    return tensors


def packed_groups(shape: MoEShape) -> list[tuple[str, list[str]]]:
    """(packed name, the per-expert names stacked into it, in expert order)."""
    groups = []
    for layer in range(shape.layers):
        for name in shape.expert_tensors():
            names = [f"layers.{layer}.mlp.experts.{e}.{name}" for e in range(shape.experts)]
            groups.append((f"layers.{layer}.mlp.experts.{name}", names))
    return groups


def malloc_trim() -> None:
    """Give freed heap pages back to the OS, so RSS shows what is really held."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def h2d_seconds(tensors: list[torch.Tensor], repeats: int = 5) -> float | None:
    """Median time (CUDA events) to copy every tensor to the GPU once; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    dst = [torch.empty_like(t, device="cuda") for t in tensors]
    times = []
    for _ in range(repeats + 1):  # the first pass warms up and is not counted
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for d, s in zip(dst, tensors, strict=False):
            d.copy_(s, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])
