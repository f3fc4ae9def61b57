"""KV bytes per token of real models, each worked out by hand from the published config."""

from __future__ import annotations

import pytest

from manager.planner.kv import (
    block_pool,
    kv_bytes_per_token,
    kv_capacity,
    kv_layout,
    kv_page_bytes,
    offload_cpu_bytes,
    offload_prefix_tokens,
)
from tests.planner.conftest import load_config

KiB = 1024


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # 2 (K and V) x layers x kv_heads x head_dim x 2 bytes (bf16)
        ("Llama-3.1-8B-Instruct", 2 * 32 * 8 * 128 * 2),  # 128 KiB, the figure everyone quotes
        ("Llama-3.1-70B-Instruct", 2 * 80 * 8 * 128 * 2),  # 320 KiB
        ("Qwen3-30B-A3B", 2 * 48 * 4 * 128 * 2),  # 96 KiB
        ("Mixtral-8x7B-v0.1", 2 * 32 * 8 * (4096 // 32) * 2),  # head_dim from hidden / heads
        # MLA: (kv_lora_rank 512 + qk_rope_head_dim 64) x 27 layers x 2 bytes, no factor 2 for V
        ("DeepSeek-V2-Lite", (512 + 64) * 27 * 2),
        # Gemma 3 12B: 48 layers, 8 KV heads, head_dim 256 (a transformers default, not in the file)
        ("gemma-3-12b-it", 2 * 48 * 8 * 256 * 2),
        # gpt-oss-20b: 24 layers x 8 KV heads x head_dim 64
        ("gpt-oss-20b", 2 * 24 * 8 * 64 * 2),
    ],
)
def test_kv_bytes_per_token_matches_hand_worked_value(name, expected):
    assert kv_bytes_per_token(load_config(name)) == expected


def test_llama_8b_is_128_kib_per_token():
    assert kv_bytes_per_token(load_config("Llama-3.1-8B-Instruct")) == 128 * KiB


def test_fp8_kv_halves_the_bytes():
    cfg = load_config("Qwen3-30B-A3B")
    assert kv_bytes_per_token(cfg, "fp8") == 2 * 48 * 4 * 128 * 1
    assert kv_bytes_per_token(cfg, "fp8") * 2 == kv_bytes_per_token(cfg)


def test_awq_model_stores_kv_in_its_float16_dtype():
    assert kv_bytes_per_token(load_config("Qwen3-Coder-30B-A3B-Instruct-AWQ")) == 2 * 48 * 4 * 128 * 2


def test_float32_model_dtype_override():
    cfg = load_config("Llama-3.1-8B-Instruct")
    assert kv_bytes_per_token(cfg, dtype="float32") == 2 * 32 * 8 * 128 * 4


def test_gemma3_has_40_sliding_and_8_full_layers():
    layout = kv_layout(load_config("gemma-3-12b-it"))
    kinds = {k.kind: k for k in layout.kinds}
    assert kinds["sliding"].layers == 40 and kinds["sliding"].window == 1024
    assert kinds["full"].layers == 8
    # Past the window only the 8 global layers grow: 2 x 8 x 8 x 256 x 2 bytes per token.
    assert layout.growing_bytes_per_token == 2 * 8 * 8 * 256 * 2


def test_gpt_oss_alternates_sliding_128_and_full():
    layout = kv_layout(load_config("gpt-oss-20b"))
    kinds = {k.kind: k for k in layout.kinds}
    assert kinds["sliding"].layers == 12 and kinds["sliding"].window == 128
    assert layout.growing_bytes_per_token == 2 * 12 * 8 * 64 * 2


def test_linear_attention_layers_add_nothing_per_token():
    # Qwen3-Next pattern: 3 Gated DeltaNet layers, then one full attention layer.
    cfg = {
        "model_type": "qwen3_next",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    }
    layout = kv_layout(cfg)
    assert kv_bytes_per_token(cfg) == 2 * 12 * 2 * 256 * 2
    linear = next(k for k in layout.kinds if k.kind == "linear")
    assert linear.layers == 36 and linear.state_bytes_per_layer > 0
    # The state is per sequence: a longer context does not make it bigger.
    assert layout.bytes_for_context(2000) - layout.bytes_for_context(1000) == 1000 * kv_bytes_per_token(cfg)


def test_page_is_block_size_tokens_over_all_layers():
    cfg = load_config("Llama-3.1-8B-Instruct")
    assert kv_page_bytes(cfg, "auto", block_size=16) == 16 * 128 * KiB
    # Tensor parallel ranks split the 8 KV heads; over all ranks the bytes are the same.
    assert kv_page_bytes(cfg, "auto", 16, tensor_parallel_size=4) == 16 * 128 * KiB
    # 16 ranks for 8 heads: every head is held twice.
    assert kv_page_bytes(cfg, "auto", 16, tensor_parallel_size=16) == 2 * 16 * 128 * KiB


def test_gemma3_pool_block_holds_one_group_of_8_layers():
    pool = block_pool(kv_layout(load_config("gemma-3-12b-it")), block_size=16)
    assert pool.group_layers == 8
    assert len(pool.groups) == 6  # 5 sliding groups + 1 full group
    assert pool.bytes_per_block == 8 * 16 * 2 * 8 * 256 * 2


def test_offload_cpu_bytes_converts_blocks():
    cfg = load_config("Qwen3-30B-A3B")
    page = 16 * 96 * KiB  # already a multiple of 4096
    assert offload_cpu_bytes(1000, cfg) == 1000 * page
    assert offload_prefix_tokens(1000 * page, cfg) == 16_000


def test_capacity_reproduces_vllm_arithmetic_for_a_uniform_model():
    layout = kv_layout(load_config("Llama-3.1-8B-Instruct"))
    budget = 10 * 2**30
    cap = kv_capacity(layout, budget, max_model_len=8192, block_size=16)
    blocks = budget // (16 * 128 * KiB)
    assert cap.num_blocks == blocks
    assert cap.kv_cache_tokens == blocks * 16  # 8192 is a whole number of blocks
    assert cap.max_concurrency == pytest.approx(blocks / (8192 / 16))
    assert cap.max_context == (blocks - 1) * 16  # one null block is held back


def test_sliding_layers_let_gemma_hold_a_longer_context_than_all_full_layers_would():
    layout = kv_layout(load_config("gemma-3-12b-it"))
    budget = 4 * 2**30
    cap = kv_capacity(layout, budget, max_model_len=32768)
    naive = budget // layout.bytes_per_token
    assert cap.max_context > 3 * naive
