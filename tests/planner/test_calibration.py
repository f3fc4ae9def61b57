"""The planner against what vLLM 0.32.0 itself reported on an H200 (bench/gpu_planner.py).

Each case is a model shape from tests/fixtures/model_configs at gpu_memory_utilization 0.85 and
max_model_len 4096 on the H200's NVML figure (143,771 MiB), with vLLM's logged "GPU KV cache size"
from the runs in bench/README.md. A plan more than 1 % above vLLM would let a start through that
does not fit; more than 1 % below would refuse one that does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from manager.planner import PlanRequest, make_plan
from manager.planner.gpus import GPU
from manager.planner.host import HostMemory

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
G = 1 << 30
H200 = GPU("NVIDIA H200", 143_771 * (1 << 20), "NVML")
HOST = HostMemory(ram_total=128 * G, ram_available=120 * G, shm_total=64 * G, shm_free=64 * G, cgroup_limit=None)

VLLM_KV_TOKENS = [  # (shape, eager, vLLM's GPU KV cache size in tokens)
    ("Llama-3.1-8B-Instruct", True, 837_104),
    ("Llama-3.1-8B-Instruct", False, 827_692),
    ("Qwen3-30B-A3B", True, 657_792),
    ("Qwen3-30B-A3B", False, 644_224),
    ("DeepSeek-V2-Lite", True, 3_025_708),
    ("DeepSeek-V2-Lite", False, 2_975_324),
    ("gemma-3-12b-it", True, 255_447),
]


def _model(tmp_path: Path, name: str) -> Path:
    config = json.loads((FIXTURES / f"{name}.json").read_text())
    config.pop("quantization_config", None)
    if config.get("model_type") == "gemma3":  # its language model, as vLLM serves the text-only shape
        from transformers import Gemma3TextConfig

        text = {k: v for k, v in config["text_config"].items() if k != "model_type"}
        config = Gemma3TextConfig(**text).to_dict() | {
            "architectures": ["Gemma3ForCausalLM"],
            "torch_dtype": "bfloat16",
        }
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("shape", "eager", "vllm_tokens"), VLLM_KV_TOKENS)
def test_the_plan_is_within_one_percent_of_vllms_kv_cache(tmp_path, shape, eager, vllm_tokens):
    request = PlanRequest(
        model=str(_model(tmp_path, shape)),
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.85,
        enforce_eager=eager,
    )
    planned = make_plan(request, gpu=H200, host=HOST).kv_cache_tokens
    assert abs(planned - vllm_tokens) / vllm_tokens < 0.01, f"plan {planned:,} vs vLLM {vllm_tokens:,}"


def test_cuda_graphs_take_kv_memory_and_eager_gives_it_back(tmp_path):
    folder = str(_model(tmp_path, "Llama-3.1-8B-Instruct"))
    graphs, eager = (
        make_plan(PlanRequest(model=folder, gpu_memory_utilization=0.85, enforce_eager=e), gpu=H200, host=HOST)
        for e in (False, True)
    )
    assert eager.kv_budget_bytes - graphs.kv_budget_bytes == pytest.approx(1.3 * G, rel=0.01)
    assert "CUDA graphs" in graphs.line("overhead").explanation


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": ["linear", 8]},
        {"rope_scaling": "linear"},
        {"rope_scaling": {"rope_type": "linear", "factor": "eight"}},
        {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}}},
        {"max_position_embeddings": None},
    ],
)
def test_odd_rotary_settings_never_break_a_plan(rope):
    from manager.planner.gpu_side import rope_cache_bytes

    cfg = {"max_position_embeddings": 1024, "hidden_size": 256, "num_attention_heads": 2, **rope}
    assert rope_cache_bytes(cfg) >= 0
    if "rope_parameters" in rope:
        assert rope_cache_bytes(cfg) == 8 * 1024 * 128 * 2  # the linear-scaled table of newer configs
