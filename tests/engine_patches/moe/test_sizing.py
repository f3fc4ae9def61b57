import pytest

from engine_patches.moe.sizing import (
    GIB,
    GRAPH_TOKENS,
    IN_PLACE_TOKENS,
    block,
    device_planned_tokens,
    expert_offload_sizing,
    graph_tokens,
    planned_tokens,
    warm_up_tokens,
)

QWEN3_30B_A3B = dict(
    num_experts=128, num_layers=48, hidden_size=2048, moe_intermediate_size=768, dtype_bytes=2, top_k=8
)


def test_qwen3_30b_experts_and_a_quarter_budget():
    all_bytes = 128 * 48 * 3 * 2048 * 768 * 2
    s = expert_offload_sizing(cache_gib=all_bytes / 4 / GIB, **QWEN3_30B_A3B)
    assert s.all_expert_bytes == all_bytes  # about 58 GB
    assert s.slots_per_layer == 32
    assert s.gpu_bytes_kept + s.gpu_bytes_freed == all_bytes
    assert s.gpu_bytes_freed == all_bytes * 3 // 4
    assert s.host_bytes == all_bytes


def test_tiny_budget_still_keeps_top_k_slots():
    s = expert_offload_sizing(cache_gib=0.0, **QWEN3_30B_A3B)
    assert s.slots_per_layer == 8
    assert s.gpu_bytes_kept == 8 * 48 * s.expert_bytes


def test_budget_above_all_experts_frees_nothing():
    s = expert_offload_sizing(cache_gib=1000, **QWEN3_30B_A3B)
    assert s.slots_per_layer == 128 and s.gpu_bytes_freed == 0


def test_cuda_graph_batches_are_the_slots_every_entry_fits_in_or_the_batches_read_partly_in_place():
    # Qwen3-30B-A3B, top_k 8: a quarter of the experts is 32 slots per layer, 4 tokens at once...
    quarter = expert_offload_sizing(cache_gib=13.5, **QWEN3_30B_A3B)
    assert quarter.slots_per_layer == 32 and device_planned_tokens(quarter.slots_per_layer, 8, 0) == 4
    assert device_planned_tokens(8, 8, 0) == 1 and device_planned_tokens(15, 8, 0) == 1
    assert device_planned_tokens(4, 8, 0) == 0  # fewer slots than top_k: no batch fits
    assert graph_tokens(quarter.slots_per_layer, 8, 0) == 4 and graph_tokens(4, 8, 0) == 0
    # ...and by default batches of up to 64 tokens are planned on the GPU, their experts without a slot
    # read in place; graphs hold those of up to 16 tokens.
    assert device_planned_tokens(quarter.slots_per_layer, 8) == IN_PLACE_TOKENS == 64
    assert graph_tokens(quarter.slots_per_layer, 8) == GRAPH_TOKENS == 16
    assert device_planned_tokens(4, 8) == 64 and graph_tokens(4, 8) == 16
    assert graph_tokens(4, 8, 8) == 8  # fewer in-place tokens than graph tokens: only those are captured
    # a cache that holds more than 16 or 64 tokens' experts
    assert graph_tokens(256, 8) == 32 and device_planned_tokens(256, 8) == 64
    assert graph_tokens(1024, 8) == device_planned_tokens(1024, 8) == 128


def test_copy_all_keeps_two_layer_buffers():
    s = expert_offload_sizing(cache_gib=0, mode="copy_all", **QWEN3_30B_A3B)
    assert s.gpu_bytes_kept == 2 * 128 * s.expert_bytes


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="moe_mode"):
        expert_offload_sizing(cache_gib=1, mode="fast", **QWEN3_30B_A3B)
    with pytest.raises(ValueError, match="moe_gpu_cache_gib"):
        expert_offload_sizing(cache_gib=-1, **QWEN3_30B_A3B)


def test_sizing_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, engine_patches.moe.sizing; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_models_of_many_experts_keep_batches_of_16_tokens_on_the_gpu_planner():
    assert planned_tokens(128, 8) == 64  # Qwen3-30B-A3B: the shape measured at 64 tokens
    assert planned_tokens(64, 6) == 64 and planned_tokens(8, 2) == 64
    assert planned_tokens(256, 8) == 16  # DeepSeek-V3: twice the planner's comparisons
    assert planned_tokens(512, 10) == 16


@pytest.mark.parametrize(("most", "top_k"), [(64, 8), (16, 8), (64, 6), (64, 1), (5, 4), (1, 8)])
def test_the_planner_warm_up_reaches_every_kernel_variant_a_batch_can_need(most, top_k):
    """A batch of a size the warm-up missed would compile the planner while requests wait."""
    sizes = warm_up_tokens(most, top_k)
    assert all(1 <= t <= most for t in sizes)
    needed = {block(t * top_k) for t in range(1, most + 1)}
    assert {block(t * top_k) for t in sizes} == needed
    assert len(sizes) == len(needed)  # one batch per variant: a few launches at start


def test_no_warm_up_where_the_planner_plans_nothing():
    assert warm_up_tokens(0, 8) == warm_up_tokens(0, 2) == warm_up_tokens(0, 1) == []
