"""Finding config.json and weight sizes locally: folders, the HF cache, safetensors headers."""

from __future__ import annotations

import json
import struct

import pytest

from manager.planner.model_files import ModelNotFound, find_model_folder, read_model, read_safetensors_header
from manager.planner.weights import estimate_weights
from tests.planner.conftest import load_config


def _write_safetensors(path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A safetensors file with the given (dtype, shape, bytes per element); data is zeros."""
    header, offset = {}, 0
    for name, (dtype, shape, size) in tensors.items():
        n = size
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_weights_come_from_headers_split_into_experts_and_dense(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_config("Qwen3-30B-A3B")))
    _write_safetensors(
        tmp_path / "model-00001-of-00002.safetensors",
        {
            "model.embed_tokens.weight": ("BF16", [1000, 64], 2),
            "model.layers.0.mlp.experts.0.gate_proj.weight": ("BF16", [32, 64], 2),
            "model.layers.0.mlp.experts.1.down_proj.weight": ("BF16", [64, 32], 2),
        },
    )
    _write_safetensors(
        tmp_path / "model-00002-of-00002.safetensors",
        {
            "model.layers.0.mlp.shared_expert.up_proj.weight": ("BF16", [32, 64], 2),
            "model.layers.0.self_attn.q_proj.scales": ("F32", [10], 4),
        },
    )
    found = read_model(str(tmp_path))
    assert found.weights.files == 2
    assert found.weights.expert_bytes == 2 * 32 * 64 * 2
    assert found.weights.total_bytes == 1000 * 64 * 2 + 3 * 32 * 64 * 2 + 40
    assert found.weights.bytes_by_dtype["F32"] == 40
    estimate = estimate_weights(found.config, found.weights)
    assert estimate.source == "safetensors headers"
    assert estimate.expert_bytes == found.weights.expert_bytes


def test_header_is_read_without_the_tensor_data(tmp_path):
    path = tmp_path / "big.safetensors"
    _write_safetensors(path, {"w": ("F16", [1024, 1024], 2)})
    assert read_safetensors_header(path)["w"]["shape"] == [1024, 1024]


def test_model_in_hf_cache_is_found_by_id(tmp_path, monkeypatch):
    snap = tmp_path / "models--Qwen--Qwen3-30B-A3B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(load_config("Qwen3-30B-A3B")))
    (tmp_path / "models--Qwen--Qwen3-30B-A3B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen3-30B-A3B" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert find_model_folder("Qwen/Qwen3-30B-A3B") == snap
    assert read_model("Qwen/Qwen3-30B-A3B").weights is None  # no safetensors: config estimate later


def test_hf_home_is_used_when_no_hub_cache_is_set(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / "r1"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert find_model_folder("org/m") == snap


def test_a_model_on_neither_this_machine_nor_asked_of_the_hub_says_what_to_give(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFound, match="neither a local folder nor in the Hugging Face cache") as missing:
        read_model("meta-llama/Llama-3.1-8B-Instruct")  # as a start's check reads: this machine alone
    assert str(tmp_path) in str(missing.value)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        find_model_folder(str(tmp_path))


@pytest.mark.parametrize(
    ("name", "published_billions"),
    [
        ("Llama-3.1-8B-Instruct", 8.03),
        ("Llama-3.1-70B-Instruct", 70.6),
        ("Qwen3-30B-A3B", 30.5),
        ("Mixtral-8x7B-v0.1", 46.7),
        ("DeepSeek-V2-Lite", 15.7),
    ],
)
def test_config_count_matches_published_parameter_counts(name, published_billions):
    estimate = estimate_weights(load_config(name))
    params = estimate.total_bytes / 2  # bf16
    assert params / 1e9 == pytest.approx(published_billions, rel=0.02)


def test_moe_experts_are_split_from_dense_weights():
    estimate = estimate_weights(load_config("Qwen3-30B-A3B"))
    # 128 experts x 48 layers x 3 x hidden 2048 x moe_intermediate 768 x 2 bytes
    assert estimate.expert_bytes == 128 * 48 * 3 * 2048 * 768 * 2
    assert estimate.experts_per_token == 8


def test_deepseek_first_layer_is_dense():
    estimate = estimate_weights(load_config("DeepSeek-V2-Lite"))
    assert estimate.moe_layers == 26
    assert estimate.expert_bytes == 64 * 26 * 3 * 2048 * 1408 * 2


def test_quantized_models_are_smaller_by_their_bits():
    awq = estimate_weights(load_config("Qwen3-Coder-30B-A3B-Instruct-AWQ"))
    full = estimate_weights(load_config("Qwen3-30B-A3B"))
    # 4-bit experts with a 16-bit scale and a 4-bit zero per 128 weights
    assert awq.expert_bytes == pytest.approx(full.expert_bytes * (4 + 20 / 128) / 16, rel=1e-6)
    gpt_oss = estimate_weights(load_config("gpt-oss-20b"))
    assert gpt_oss.bits_per_weight == 4.25
    assert gpt_oss.total_bytes / 1e9 == pytest.approx(13.8, rel=0.03)  # the published checkpoint
