"""KV cache sizes from a model's config.json, laid out the way vLLM 0.32 lays them out.

Attention kinds and what one token costs in one layer (b = bytes of the KV dtype):
  full (MHA/GQA)   2 x kv_heads x head_dim x b        grows with the context
  sliding window   the same per token, but vLLM keeps only the window (+ in-flight tokens)
  MLA (DeepSeek)   (kv_lora_rank + qk_rope_head_dim) x b   one latent, no separate V
  linear attention a fixed state per sequence (Mamba / Gated DeltaNet), nothing per token

How vLLM turns memory into blocks (v1/core/kv_cache_utils.py, get_kv_cache_config_from_groups):
layers of one kind are put in KV cache groups of equal size (hybrid models: the size of the
smallest kind, e.g. Gemma 3's 8 full layers); one block of the shared pool holds ``block_size``
tokens for every layer of one group, so ``num_blocks = KV memory // (group layers x page)``.
A request takes cdiv(len, block_size) blocks in each full group and, in each sliding group,
cdiv(min(window - 1 + in-flight tokens, len), block_size) + 1: vLLM frees blocks behind the window
only once the batches in flight are done (scheduling.py says how many tokens that is). Without the
hybrid KV cache manager sliding layers next to full ones are allocated as full. The log line "GPU KV cache size: N tokens" is int(max concurrency x
max_model_len), where max concurrency = num_blocks / blocks one max_model_len request takes.

What one block of the OffloadingConnector is (CPU KV offload, vLLM 0.32; read from
distributed/kv_transfer/kv_connector/v1/offloading/config.py and v1/kv_offload/cpu/spec.py):
  * ``worker_kv_bytes_per_block`` = the worker's whole GPU KV allocation / num_blocks, i.e. one
    GPU block of ``block_size`` tokens over ALL layers that worker holds (for hybrid models: one
    pool block, the largest group's layers).
  * ``cpu_bytes_to_use`` is for the whole server, all TP ranks together: a CPU chunk is
    worker bytes x world_size (x ``blocks_per_chunk``, default 1), rounded up to the page size
    (4096), and ``num_chunks = cpu_bytes_to_use // that``. MLA models under single-node TP keep
    one copy instead of world_size (the latent is the same on every rank).
  * ``--kv-offloading-size GiB`` becomes ``cpu_bytes_to_use = GiB x 2**30``.
So ``cpu_bytes_to_use = num_cpu_blocks x kv_page_bytes(cfg, dtype, block_size, tp)`` rounded as
``offload_cpu_bytes`` does. The CPU tier holds prefix-cache blocks; it does NOT let one request
hold more context than the GPU KV cache: the scheduler needs GPU blocks for the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from manager.planner.hf_config import (
    dtype_bytes,
    head_dim,
    model_dtype_name,
    num_kv_heads,
    require,
    text_config,
)

PAGE_ALIGNMENT = 4096  # mmap.PAGESIZE: vLLM rounds each CPU offload chunk up to it


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AttentionKind:
    """The layers of one attention kind and what each costs."""

    kind: str  # "full", "sliding", "mla", "linear"
    layers: int
    bytes_per_token_per_layer: int  # 0 for linear attention
    window: int | None = None  # sliding window in tokens
    state_bytes_per_layer: int = 0  # linear attention: fixed bytes per sequence
    kv_heads: int = 0  # per layer, whole model (before tensor parallelism)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.bytes_per_token_per_layer


@dataclass(frozen=True)
class KVLayout:
    """All attention layers of a model and the KV dtype they are stored in."""

    kinds: tuple[AttentionKind, ...]
    kv_dtype: str

    @property
    def bytes_per_token(self) -> int:
        """One token in every attention layer (sliding layers included, while inside the window)."""
        return sum(k.bytes_per_token for k in self.kinds)

    @property
    def growing_bytes_per_token(self) -> int:
        """What each further token of a long context costs: full and MLA layers only."""
        return sum(k.bytes_per_token for k in self.kinds if k.kind in ("full", "mla"))

    @property
    def is_hybrid(self) -> bool:
        return len({(k.kind, k.window) for k in self.kinds if k.layers}) > 1

    @property
    def uses_mla(self) -> bool:
        return any(k.kind == "mla" for k in self.kinds)

    def bytes_for_context(self, tokens: int, in_flight_tokens: int = 2048) -> int:
        """KV bytes one sequence of ``tokens`` holds, ignoring block rounding."""
        total = 0
        for k in self.kinds:
            if k.kind == "sliding" and k.window:
                total += k.bytes_per_token * min(tokens, k.window - 1 + in_flight_tokens)
            elif k.kind == "linear":
                total += k.layers * k.state_bytes_per_layer
            else:
                total += k.bytes_per_token * tokens
        return total


def kv_dtype_name(cfg: dict[str, Any], kv_cache_dtype: str = "auto", dtype: str = "auto") -> str:
    if kv_cache_dtype and kv_cache_dtype != "auto":
        return kv_cache_dtype
    return model_dtype_name(cfg, dtype)


def _layer_types(cfg: dict[str, Any], layers: int) -> list[str]:
    """Per-layer attention type, from ``layer_types`` or the older pattern keys."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) >= layers:
        return [str(t) for t in types[:layers]]
    model_type = cfg.get("model_type", "")
    window = cfg.get("sliding_window")
    if model_type == "gemma3_text" and window:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if model_type == "gemma2" and window:
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if cfg.get("full_attention_interval"):  # Qwen3-Next: 3 linear layers, then 1 full
        interval = int(cfg["full_attention_interval"])
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    # Mistral-style models slide on every layer; Qwen2/3 carry a window they do not use.
    if (
        window
        and cfg.get("use_sliding_window", True)
        and model_type not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    ):
        return ["sliding_attention"] * layers
    return ["full_attention"] * layers


def _linear_state_bytes(cfg: dict[str, Any], b: int) -> int:
    """Gated DeltaNet (Qwen3-Next) state of one layer for one sequence: conv + recurrent."""
    k_heads = int(cfg.get("linear_num_key_heads") or 0)
    v_heads = int(cfg.get("linear_num_value_heads") or 0)
    k_dim = int(cfg.get("linear_key_head_dim") or 0)
    v_dim = int(cfg.get("linear_value_head_dim") or 0)
    kernel = int(cfg.get("linear_conv_kernel_dim") or 4)
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * (kernel - 1) * b
    return conv + v_heads * k_dim * v_dim * b


def kv_layout(hf_config: dict[str, Any], kv_cache_dtype: str = "auto", dtype: str = "auto") -> KVLayout:
    """The model's attention layers grouped by kind, with bytes per token at the KV dtype."""
    cfg = text_config(hf_config)
    layers = require(cfg, "num_hidden_layers", "n_layer", "num_layers")
    kv_name = kv_dtype_name(cfg, kv_cache_dtype, dtype)
    b = dtype_bytes(kv_name)

    if cfg.get("kv_lora_rank"):  # MLA: one compressed latent + the rotary part per token
        per_layer = (int(cfg["kv_lora_rank"]) + require(cfg, "qk_rope_head_dim")) * b
        return KVLayout((AttentionKind("mla", layers, per_layer, kv_heads=1),), kv_name)

    kv_heads = num_kv_heads(cfg)
    per_layer = 2 * kv_heads * head_dim(cfg) * b
    window = cfg.get("sliding_window")
    counts: dict[str, int] = {}
    for t in _layer_types(cfg, layers):
        counts[t] = counts.get(t, 0) + 1

    kinds: list[AttentionKind] = []
    for t, n in counts.items():
        if t in ("sliding_attention", "sliding", "local_attention") and window:
            kinds.append(AttentionKind("sliding", n, per_layer, window=int(window), kv_heads=kv_heads))
        elif t in ("linear_attention", "mamba", "conv"):
            kinds.append(AttentionKind("linear", n, 0, state_bytes_per_layer=_linear_state_bytes(cfg, b)))
        else:  # full attention, and kinds vLLM allocates like it (chunked local is treated as full)
            kinds.append(AttentionKind("full", n, per_layer, kv_heads=kv_heads))
    return KVLayout(tuple(kinds), kv_name)


def kv_bytes_per_token(hf_config: dict[str, Any], kv_cache_dtype: str = "auto", dtype: str = "auto") -> int:
    """KV bytes of one token over all attention layers of the whole model (all TP ranks together).

    Sliding-window layers count here (a token inside their window is stored there too); use
    ``kv_layout(...).growing_bytes_per_token`` for what each further token of a long context
    costs. Linear-attention layers hold a per-sequence state and add nothing per token.
    """
    return kv_layout(hf_config, kv_cache_dtype, dtype).bytes_per_token


@dataclass(frozen=True)
class BlockPool:
    """vLLM's grouping of layers into KV cache groups, and the bytes of one pool block."""

    group_layers: int  # layers in every group (padding included)
    groups: tuple[AttentionKind, ...]  # one entry per group (an attention kind may have several)
    block_size: int
    page_bytes_per_layer: int  # one layer, one block, whole model (all TP ranks)

    @property
    def bytes_per_block(self) -> int:
        return self.group_layers * self.page_bytes_per_layer

    def blocks_per_request(self, tokens: int, in_flight_tokens: int = 2048) -> int:
        """Blocks one request of ``tokens`` takes (SlidingWindowSpec/FullAttentionSpec in vLLM)."""
        total = 0
        for g in self.groups:
            if g.kind == "sliding" and g.window:
                held = min(g.window - 1 + in_flight_tokens, tokens)
                total += cdiv(held, self.block_size) + 1
            elif g.kind == "linear":
                total += 1
            else:
                total += cdiv(tokens, self.block_size)
        return total


def as_full_attention(layout: KVLayout) -> KVLayout:
    """The layout vLLM allocates without the hybrid KV cache manager (unify_hybrid_kv_cache_specs): next to
    full-attention layers, sliding-window layers keep every token. Layers that all slide keep their window."""
    attention = [k for k in layout.kinds if k.layers and k.kind in ("full", "sliding")]
    if not any(k.kind == "sliding" for k in attention) or not any(k.kind == "full" for k in attention):
        return layout
    merged = AttentionKind(
        "full",
        sum(k.layers for k in attention),
        max(k.bytes_per_token_per_layer for k in attention),
        kv_heads=max(k.kv_heads for k in attention),
    )
    return KVLayout((merged, *(k for k in layout.kinds if k not in attention)), layout.kv_dtype)


def block_pool(layout: KVLayout, block_size: int = 16, hybrid: bool = True) -> BlockPool:
    """Group layers as vLLM's _get_kv_cache_groups_uniform_page_size does; ``hybrid`` False: as it does
    with the hybrid KV cache manager off."""
    if not hybrid:
        layout = as_full_attention(layout)
    kinds = [k for k in layout.kinds if k.layers and k.kind != "linear"]
    linear = [k for k in layout.kinds if k.layers and k.kind == "linear"]
    if not kinds:
        raise ValueError("this model has no attention layers with a KV cache")
    page = max(k.bytes_per_token_per_layer for k in kinds) * block_size
    smallest = min(k.layers for k in kinds)
    largest = max(k.layers for k in kinds)
    # vLLM pads to the largest kind when kinds are close in size (gpt-oss 12 + 12).
    group_layers = largest if largest < smallest * 1.5 else smallest
    groups: list[AttentionKind] = []
    for k in kinds:
        groups.extend([k] * cdiv(k.layers, group_layers))
    groups.extend(linear)  # approximation: one pool block of state per sequence and layer group
    return BlockPool(group_layers, tuple(groups), block_size, page)


def kv_page_bytes(
    hf_config: dict[str, Any],
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
) -> int:
    """Bytes of one vLLM KV block (``block_size`` tokens, every layer of a pool block), all TP ranks.

    This is the unit of the OffloadingConnector's CPU tier (see the module docstring). With
    tensor parallelism each rank holds max(1, kv_heads // tp) heads, so replicated heads count
    once per rank; an MLA latent is counted once (vLLM keeps one copy on single-node TP).
    """
    layout = kv_layout(hf_config, kv_cache_dtype, dtype)
    pool = block_pool(layout, block_size)
    if layout.uses_mla or tensor_parallel_size <= 1:
        return pool.bytes_per_block
    kv_heads = max(k.kv_heads for k in layout.kinds)
    per_rank_heads = max(1, kv_heads // tensor_parallel_size)
    return pool.bytes_per_block * per_rank_heads * tensor_parallel_size // kv_heads


def offload_cpu_bytes(
    num_cpu_blocks: int,
    hf_config: dict[str, Any],
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
) -> int:
    """``cpu_bytes_to_use`` that gives the OffloadingConnector ``num_cpu_blocks`` blocks."""
    chunk = kv_page_bytes(hf_config, kv_cache_dtype, block_size, tensor_parallel_size, dtype)
    return num_cpu_blocks * cdiv(chunk, PAGE_ALIGNMENT) * PAGE_ALIGNMENT


def offload_prefix_tokens(
    cpu_bytes: int,
    hf_config: dict[str, Any],
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
) -> int:
    """Prefix-cache capacity in tokens that ``cpu_bytes`` of CPU KV offload holds (not context)."""
    chunk = kv_page_bytes(hf_config, kv_cache_dtype, block_size, tensor_parallel_size, dtype)
    return (cpu_bytes // (cdiv(chunk, PAGE_ALIGNMENT) * PAGE_ALIGNMENT)) * block_size


@dataclass(frozen=True)
class KVCapacity:
    """What a KV budget holds, computed as vLLM 0.32 computes it."""

    num_blocks: int
    kv_cache_tokens: int  # what vLLM logs as "KV cache size: N tokens"
    max_concurrency: float  # requests of max_model_len at once
    max_context: int  # longest single request the pool can hold


def kv_capacity(
    layout: KVLayout,
    kv_budget_bytes: int,
    max_model_len: int,
    block_size: int = 16,
    in_flight_tokens: int = 2048,
    hybrid: bool = True,
) -> KVCapacity:
    """Blocks, reported tokens, concurrency and the longest request for a KV budget of one rank set.

    ``in_flight_tokens``: batches in flight x max_num_batched_tokens (see scheduling.py); ``hybrid``:
    whether vLLM's hybrid KV cache manager is on."""
    pool = block_pool(layout, block_size, hybrid)
    num_blocks = max(0, kv_budget_bytes // pool.bytes_per_block)
    per_request = pool.blocks_per_request(max_model_len, in_flight_tokens)
    concurrency = num_blocks / per_request if per_request else 0.0
    usable = num_blocks - 1  # the null block vLLM's BlockPool holds back
    # Layers that all slide hold a window however long the request: the search stops at max_model_len.
    lo, hi = 0, max(1, usable * block_size, max_model_len)
    while lo < hi:  # longest context whose blocks fit; blocks_per_request grows with tokens
        mid = (lo + hi + 1) // 2
        if pool.blocks_per_request(mid, in_flight_tokens) <= usable:
            lo = mid
        else:
            hi = mid - 1
    return KVCapacity(num_blocks, int(concurrency * max_model_len), concurrency, lo)


def rank_layout(layout: KVLayout, tensor_parallel_size: int) -> KVLayout:
    """The share of the KV one tensor-parallel rank holds.

    Each rank holds max(1, kv_heads // tp) heads (heads are replicated when tp > kv_heads);
    an MLA latent is not split, every rank holds all of it.
    """
    if tensor_parallel_size <= 1:
        return layout
    kinds = []
    for k in layout.kinds:
        if k.kind in ("full", "sliding") and k.kv_heads:
            per_rank = max(1, k.kv_heads // tensor_parallel_size)
            kinds.append(
                AttentionKind(
                    k.kind,
                    k.layers,
                    k.bytes_per_token_per_layer * per_rank // k.kv_heads,
                    k.window,
                    k.state_bytes_per_layer,
                    per_rank,
                )
            )
        elif k.kind == "linear":
            kinds.append(
                AttentionKind(
                    k.kind, k.layers, 0, k.window, k.state_bytes_per_layer // tensor_parallel_size, k.kv_heads
                )
            )
        else:
            kinds.append(k)
    return KVLayout(tuple(kinds), layout.kv_dtype)
