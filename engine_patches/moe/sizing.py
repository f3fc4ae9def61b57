"""How much GPU memory MoE expert offload keeps and frees: pure arithmetic, no torch.

The planner imports this to count the GPU bytes the offload gives back to the KV cache. The same
function sizes the real cache (``ExpertOffload``), so the plan and the engine agree on the slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GIB = 1024**3

OffloadMode = Literal["cached", "copy_all"]
# Which expert the GPU planner evicts: the least used (decayed use counts) or the least recent.
CachePolicy = Literal["lru", "frequency"]
CACHE_POLICIES: tuple[CachePolicy, ...] = ("lru", "frequency")
# On the H200 under the routing stand-in, use counts hit 82.5 % against LRU's 77.7 % at batch 1 and
# ran 16 % faster; at batches of 8 and 64 the two hit the same (bench/README.md).
DEFAULT_CACHE_POLICY: CachePolicy = "frequency"


@dataclass(frozen=True)
class ExpertOffloadSizing:
    """GPU and host bytes of the expert weights with offload on (all counts are bytes)."""

    mode: OffloadMode
    expert_bytes: int  # one expert of one layer: w13 (2*I x H) plus w2 (H x I)
    all_expert_bytes: int  # every expert of every layer: what stays on the GPU without offload
    slots_per_layer: int  # experts of one layer the GPU holds at once
    gpu_bytes_kept: int  # GPU bytes the offload still uses (cache slots or copy-all staging)
    gpu_bytes_freed: int  # all_expert_bytes - gpu_bytes_kept; negative means offload costs memory
    host_bytes: int  # pinned host memory the expert store takes

    @property
    def cached_fraction(self) -> float:
        """Share of all expert bytes that sit on the GPU."""
        return self.gpu_bytes_kept / self.all_expert_bytes if self.all_expert_bytes else 0.0


def expert_bytes(hidden_size: int, moe_intermediate_size: int, dtype_bytes: float) -> int:
    """Bytes of one expert's weights (gate+up fused as w13, then down as w2)."""
    return int(3 * hidden_size * moe_intermediate_size * dtype_bytes)


def slots_for_budget(cache_gib: float, *, num_experts: int, num_layers: int, one_expert_bytes: int, top_k: int) -> int:
    """Cache slots per layer that fit in ``cache_gib``; at least top_k so one token fits in one pass."""
    if num_experts <= 0 or num_layers <= 0 or one_expert_bytes <= 0:
        raise ValueError(
            f"expert offload needs positive sizes, got num_experts={num_experts}, "
            f"num_layers={num_layers}, expert bytes={one_expert_bytes}"
        )
    if cache_gib < 0:
        raise ValueError(f"moe_gpu_cache_gib must be >= 0, got {cache_gib}")
    fit = int(cache_gib * GIB) // (num_layers * one_expert_bytes)
    return max(min(top_k, num_experts), min(fit, num_experts))


# Batches of up to this many tokens are planned on the GPU even when their experts may not all fit
# in the cache: those left without a slot are read in place from pinned host memory by the expert
# kernels. The plugin's ``moe_in_place_tokens`` setting (0: off) changes it for one engine; unset, it is
# ``planned_tokens`` of the model.
# Planned on the host instead, a batch reads the router's choices back at every layer and goes
# through the cache in rounds; on the H200, 12 layers at a 25 % cache, planning batches of 32 and 64
# tokens on the GPU made them 25 % and 11 % faster (bench/README.md).
IN_PLACE_TOKENS = 64

# Batches of 64 tokens planned on the GPU were measured at 128 experts and top-8 (Qwen3-30B-A3B), on
# the H200 and the H100. A model with more experts or a larger top_k keeps batches of up to 16 tokens
# (``planned_tokens``): nothing of that size was measured. (The planner no longer compares every
# entry with every expert, which set this bound first; it matches them through a scratch row.)
PLANNER_PAIRS = 128 * 512
SMALL_IN_PLACE_TOKENS = 16


def block(n: int) -> int:
    """The GPU planner kernel's block for ``n`` items: the power of two at or above it, at least 2."""
    return max(2, 1 << (int(n) - 1).bit_length())


def planned_tokens(num_experts: int, top_k: int) -> int:
    """The plugin's default ``moe_in_place_tokens`` for a model: 64, or 16 where the planner's
    comparisons of a 64-token batch would pass ``PLANNER_PAIRS``."""
    fits = block(num_experts) * block(IN_PLACE_TOKENS * max(1, top_k)) <= PLANNER_PAIRS
    return IN_PLACE_TOKENS if fits else SMALL_IN_PLACE_TOKENS


# CUDA graphs are captured for batches of up to this many tokens (or slots/top_k, if more). A batch
# of 17 to 64 tokens planned on the GPU runs outside graphs: its step is link-bound (over 100 ms at
# a 25 % cache), so launches cost little there, while vLLM's estimate of the graph pool, which it
# takes from the KV cache, grew from 0.07 to 1.49 GiB with graphs up to 64 tokens (12 layers).
GRAPH_TOKENS = 16


def in_place_tokens(pin_budget_bytes: int | None, expert_bytes_per_process: int) -> int:
    """How many tokens a batch planned on the GPU may have when its experts do not all fit in the cache.

    Reading experts in place needs them all in pinned memory; a pin budget (shared by the process's
    pinned buffers) smaller than the process's experts leaves them pageable, and then only batches
    whose every expert fits are planned on the GPU: 0."""
    if pin_budget_bytes is not None and pin_budget_bytes < expert_bytes_per_process:
        return 0
    return IN_PLACE_TOKENS


def device_planned_tokens(slots_per_layer: int, top_k: int, in_place_tokens: int = IN_PLACE_TOKENS) -> int:
    """The largest batch (in tokens) whose experts the GPU planner places without the host.

    A batch whose every (token, k) entry fits in a slot at once (``DeviceSlotTables.fits``), or one
    of up to ``in_place_tokens`` tokens (the experts that find no slot read in place). A CUDA graph
    may hold only such batches."""
    return max(slots_per_layer // max(1, top_k), in_place_tokens)


def warm_up_tokens(max_tokens: int, top_k: int) -> list[int]:
    """One batch size (in tokens) per block of the GPU planner kernel, up to ``max_tokens``.

    The kernel is compiled once per block of (token, k) entries (``block``), at its first launch of
    that block. CUDA graph capture launches it for the captured sizes only; planning one batch of each
    of these sizes at start compiles the rest (17 to 64 tokens, by default), so no request waits for a
    compile. Each size is the largest of its block, at most ``max_tokens``."""
    if max_tokens < 1:
        return []
    k = max(1, int(top_k))
    last = block(int(max_tokens) * k)
    sizes: list[int] = []
    b = block(k)
    while b <= last:  # doubles: about log2(max_tokens) sizes
        tokens = min(max(1, b // k), max_tokens)
        if block(tokens * k) == b:
            sizes.append(tokens)
        b *= 2
    return sizes


# Batches of up to this many tokens run vLLM's expert kernel once each while the engine starts
# (``ExpertOffload.warm_up_experts``): its Triton kernel compiles per tile config and per whether a
# batch's entry count divides by 16, and a resident engine's CUDA graph capture, which goes this far
# by default, compiles every such variant before it serves. An offload engine captures 16 tokens.
KERNEL_WARM_UP_TOKENS = 512


def graph_tokens(slots_per_layer: int, top_k: int, in_place_tokens: int = IN_PLACE_TOKENS) -> int:
    """The largest batch (in tokens) captured in a CUDA graph: vLLM's ``max_cudagraph_capture_size``.

    Every such batch is planned on the GPU (``device_planned_tokens``); batches planned on the GPU
    beyond ``GRAPH_TOKENS`` run outside graphs."""
    return max(slots_per_layer // max(1, top_k), min(in_place_tokens, GRAPH_TOKENS))


def expert_offload_sizing(
    *,
    num_experts: int,
    num_layers: int,
    hidden_size: int,
    moe_intermediate_size: int,
    dtype_bytes: float,
    cache_gib: float,
    top_k: int = 8,
    mode: OffloadMode = "cached",
) -> ExpertOffloadSizing:
    """GPU bytes kept and freed when the experts of ``num_layers`` MoE layers live in host memory.

    ``cached``: a per-layer LRU cache of ``slots_per_layer`` experts (budget ``cache_gib``).
    ``copy_all``: no cache, two staging buffers of one whole layer each (ping-pong).
    """
    one = expert_bytes(hidden_size, moe_intermediate_size, dtype_bytes)
    total = one * num_experts * num_layers
    if mode == "cached":
        slots = slots_for_budget(
            cache_gib,
            num_experts=num_experts,
            num_layers=num_layers,
            one_expert_bytes=one,
            top_k=top_k,
        )
        kept = slots * num_layers * one
    elif mode == "copy_all":
        slots = num_experts
        kept = 2 * num_experts * one
    else:
        raise ValueError(f"moe_mode must be 'cached' or 'copy_all', got {mode!r}")
    return ExpertOffloadSizing(
        mode=mode,
        expert_bytes=one,
        all_expert_bytes=total,
        slots_per_layer=slots,
        gpu_bytes_kept=kept,
        gpu_bytes_freed=total - kept,
        host_bytes=total,
    )
