"""build_command on its own: the exact argv and environment for representative configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from manager.errors import Invalid
from manager.launch.command import ENTRY_MODULE, build_command
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
PYTHON = "/opt/engine/bin/python"
HEAD = [PYTHON, "-m", ENTRY_MODULE]
# The manager's own probes stay out of the engine's access log: the last managed flag of every argv.
QUIET = "--disable-access-log-for-endpoints=/health,/v1/models,/metrics,/is_sleeping"


def _build(config: ModelConfig, profile: OffloadProfile | None = None, **launch):
    return build_command(config, profile, engine_python=PYTHON, port=8001, **launch)


def _patches(env: dict[str, str]) -> dict:
    return json.loads(env["VLLM_MANAGER_PATCHES"])


def test_a_plain_config_gets_only_what_the_manager_always_sets():
    cmd = _build(ModelConfig(name="plain", model="/models/llama"))
    assert cmd.argv == HEAD + [
        "--model=/models/llama",
        "--served-model-name=plain",
        "--host=127.0.0.1",
        "--port=8001",
        "--gpu-memory-utilization=0.9",
        QUIET,
    ]
    assert cmd.engine_argv == cmd.argv[3:]
    assert set(cmd.env) == {"VLLM_PLUGINS", "VLLM_MANAGER_PATCHES"}
    assert cmd.env["VLLM_PLUGINS"] == "offload_patches"
    assert _patches(cmd.env)["run_dir"] is None and _patches(cmd.env)["moe_offload"] is False
    assert cmd.notes == []


def test_tp2_with_fp8_kv_on_two_gpus():
    config = ModelConfig(
        name="qwen-tp2",
        model="Qwen/Qwen3-8B",
        served_model_name="qwen",
        dtype="bfloat16",
        quantization="fp8",
        tensor_parallel_size=2,
        gpu_ids=[2, 3],
        gpu_memory_utilization=0.1 + 0.2,
        max_model_len=32768,
        max_num_seqs=16,
        kv_cache_dtype="fp8",
        enforce_eager=True,
        enable_prefix_caching=True,
    )
    cmd = _build(config, gpus=[2, 3], run_dir=Path("/data/run/7"), host="0.0.0.0")
    assert cmd.argv == HEAD + [
        "--model=Qwen/Qwen3-8B",
        "--served-model-name=qwen",
        "--host=0.0.0.0",
        "--port=8001",
        "--dtype=bfloat16",
        "--quantization=fp8",
        "--tensor-parallel-size=2",
        "--gpu-memory-utilization=0.30000000000000004",  # every digit the user stored
        "--max-model-len=32768",
        "--max-num-seqs=16",
        "--kv-cache-dtype=fp8",
        "--enforce-eager",
        "--enable-prefix-caching",
        QUIET,
    ]
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert _patches(cmd.env)["run_dir"] == "/data/run/7"


def test_lora_flags_runtime_loading_and_the_cpu_pool():
    config = ModelConfig(
        name="lora", model="/models/m", enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=8
    )
    cmd = _build(config, OffloadProfile(name="pool", lora_cpu_pooling=True, lora_pool_gib=2))
    assert cmd.engine_argv[-5:] == [
        "--enable-lora", "--max-loras=4", "--max-lora-rank=16", "--max-cpu-loras=8", QUIET
    ]  # fmt: skip
    assert cmd.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    patches = _patches(cmd.env)
    assert patches["lora_pool"] is True and patches["lora_pool_bytes"] == 2 << 30 and patches["max_cpu_loras"] == 8


def test_lora_limits_are_left_out_while_lora_is_off():
    config = ModelConfig(name="plain", model="/models/m", max_loras=4, max_lora_rank=16, max_cpu_loras=8)
    cmd = _build(config)
    assert not any("lora" in part for part in cmd.argv)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in cmd.env


def test_kv_offload_from_a_profiles_gib():
    profile = OffloadProfile(name="kv", kv_offload_gib=2.5, pinned_budget_gib=1)
    cmd = _build(ModelConfig(name="kv", model="/models/m", max_model_len=4096), profile)
    assert cmd.engine_argv[-4:] == [
        "--max-model-len=4096",
        "--kv-offloading-size=2.5",
        "--kv-offloading-backend=native",
        QUIET,
    ]
    assert _patches(cmd.env)["pin_budget_bytes"] == 1 << 30


def test_kv_offload_with_arc_eviction_goes_through_the_connector_config():
    profile = OffloadProfile(name="kv-arc", kv_offload_gib=1, kv_eviction_policy="arc")
    cmd = _build(ModelConfig(name="arc", model="/models/m"), profile)
    assert not any(part.startswith("--kv-offloading") for part in cmd.argv)
    assert cmd.argv[-2] == "--kv-transfer-config"
    assert json.loads(cmd.argv[-1]) == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, "eviction_policy": "arc"},
    }


def _qwen3_moe(tmp_path: Path) -> str:
    folder = tmp_path / "Qwen3-30B-A3B"
    folder.mkdir()
    shutil.copy(FIXTURES / "Qwen3-30B-A3B.json", folder / "config.json")
    return str(folder)


def test_moe_offload_keeps_cuda_graphs_up_to_the_batch_the_gpu_plans(tmp_path):
    # 13.5 GiB over 48 layers of 9 MiB experts (3 x 2048 x 768 x 2 bytes) = 32 slots per layer;
    # top_k 8, so every expert of a batch of up to 4 tokens fits; the GPU plans batches of up to 64
    # tokens (experts that find no slot read in place), and those of up to 16 run in CUDA graphs.
    profile = OffloadProfile(name="moe", moe_expert_offload=True, moe_gpu_cache_gib=13.5)
    model = _qwen3_moe(tmp_path)
    cmd = _build(ModelConfig(name="moe", model=model), profile)
    assert "--enforce-eager" not in cmd.argv
    i = cmd.argv.index("--max-cudagraph-capture-size")
    assert cmd.argv[i + 1] == "16"
    assert cmd.notes[0].startswith("--max-cudagraph-capture-size 16 added: MoE expert offload runs batches of up to 16")
    assert "read in place" in cmd.notes[0]
    assert _patches(cmd.env)["moe_offload"] is True and _patches(cmd.env)["moe_gpu_cache_gib"] == 13.5

    # A tenth of the experts on the GPU (12 slots, one token's experts): still 16.
    tenth = profile.model_copy(update={"moe_gpu_cache_gib": 5.4})
    small = _build(ModelConfig(name="moe", model=model), tenth)
    assert small.argv[small.argv.index("--max-cudagraph-capture-size") + 1] == "16"

    # A pin budget below the experts' 54 GiB leaves them pageable: nothing can be read in place, so
    # only the batches whose every expert fits (4 tokens at 32 slots) may be captured.
    budget = profile.model_copy(update={"pinned_budget_gib": 8})
    pageable = _build(ModelConfig(name="moe", model=model), budget)
    assert pageable.argv[pageable.argv.index("--max-cudagraph-capture-size") + 1] == "4"
    roomy = profile.model_copy(update={"pinned_budget_gib": 64})
    wide = _build(ModelConfig(name="moe", model=model), roomy)
    assert wide.argv[wide.argv.index("--max-cudagraph-capture-size") + 1] == "16"


def test_moe_offload_keeps_graph_sizes_the_config_sets_and_says_what_fits(tmp_path):
    profile = OffloadProfile(name="moe", moe_expert_offload=True, moe_gpu_cache_gib=13.5)
    config = ModelConfig(name="moe", model=_qwen3_moe(tmp_path), extra_args=["-cc.cudagraph_capture_sizes=[1,2]"])
    cmd = _build(config, profile)
    assert "--max-cudagraph-capture-size" not in cmd.argv and "--enforce-eager" not in cmd.argv
    assert cmd.argv[-1] == "-cc.cudagraph_capture_sizes=[1,2]"
    assert "batches of up to 16 tokens" in cmd.notes[0] and "kept" in cmd.notes[0]


def test_moe_offload_runs_eager_when_the_model_config_cannot_be_read():
    profile = OffloadProfile(name="moe", moe_expert_offload=True, moe_gpu_cache_gib=6.5)
    cmd = _build(ModelConfig(name="moe", model="/models/m"), profile)
    assert cmd.argv.count("--enforce-eager") == 1 and "--max-cudagraph-capture-size" not in cmd.argv
    assert cmd.notes == [
        "--enforce-eager added: MoE expert offload sizes its CUDA graphs from the model's config.json, "
        "which could not be read"
    ]
    eager_anyway = _build(ModelConfig(name="moe", model="/models/m", enforce_eager=True), profile)
    assert eager_anyway.argv.count("--enforce-eager") == 1 and eager_anyway.notes == []
    eager_in_extra = _build(ModelConfig(name="moe", model="/models/m", extra_args=["--enforce-eager"]), profile)
    assert eager_in_extra.argv.count("--enforce-eager") == 1 and eager_in_extra.notes == []


def test_moe_offload_on_a_dense_model_limits_nothing(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    shutil.copy(FIXTURES / "Llama-3.1-8B-Instruct.json", folder / "config.json")
    profile = OffloadProfile(name="moe", moe_expert_offload=True, moe_gpu_cache_gib=4)
    cmd = _build(ModelConfig(name="dense", model=str(folder)), profile)
    assert "--enforce-eager" not in cmd.argv and "--max-cudagraph-capture-size" not in cmd.argv
    assert cmd.notes == []


def test_extra_args_come_last_and_the_configs_plugins_stay_allowed():
    config = ModelConfig(
        name="extra",
        model="/models/m",
        enable_prefix_caching=False,
        extra_args=["--enable-chunked-prefill", "--max-num-batched-tokens", "2048"],
        env={"VLLM_PLUGINS": "lora_resolver", "HF_HUB_OFFLINE": "1"},
    )
    cmd = _build(config, OffloadProfile(name="kv", kv_offload_gib=4))
    assert cmd.engine_argv[-7:] == [
        "--no-enable-prefix-caching",
        "--kv-offloading-size=4",
        "--kv-offloading-backend=native",
        QUIET,
        "--enable-chunked-prefill", "--max-num-batched-tokens", "2048",
    ]  # fmt: skip
    assert cmd.env["VLLM_PLUGINS"] == "lora_resolver,offload_patches"
    assert cmd.env["HF_HUB_OFFLINE"] == "1"


def test_the_managers_probes_stay_out_of_the_engines_access_log_unless_extra_args_decide_it():
    assert QUIET in _build(ModelConfig(name="q", model="/models/m")).engine_argv
    for own in (["--disable-uvicorn-access-log"], ["--disable-access-log-for-endpoints", "/health"]):
        cmd = _build(ModelConfig(name="q", model="/models/m", extra_args=own))
        assert QUIET not in cmd.engine_argv and cmd.engine_argv[-len(own) :] == own


def test_sleep_mode_adds_the_flag_and_the_dev_endpoint_switch():
    for level in (1, 2):
        cmd = _build(ModelConfig(name="s", model="/models/m", sleep_level=level))
        assert cmd.engine_argv.count("--enable-sleep-mode") == 1
        assert cmd.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert cmd.notes == []
    off = _build(ModelConfig(name="s", model="/models/m"))
    assert "--enable-sleep-mode" not in off.argv and "VLLM_SERVER_DEV_MODE" not in off.env
    # On a public bind the dev endpoints would be reachable by anyone: the preview says so.
    public = _build(ModelConfig(name="s", model="/models/m", sleep_level=1), host="0.0.0.0")
    assert "dev endpoints" in public.notes[0] and "0.0.0.0" in public.notes[0]


def test_sleep_mode_is_the_configs_field_not_an_extra_arg():
    import pytest

    from manager.errors import Invalid
    from manager.launch.refusals import check_extra_args

    with pytest.raises(Invalid, match="use the config field sleep_level instead"):
        check_extra_args(["--enable-sleep-mode"], allow_code_flags=False)


def test_sleep_level_one_engines_get_the_sleep_pool_unless_their_profile_turns_it_off():
    def pool(config: ModelConfig, profile: OffloadProfile | None = None) -> bool:
        return _patches(_build(config, profile).env)["sleep_pool"]

    base = ModelConfig(name="s", model="/models/llama")
    assert pool(base.model_copy(update={"sleep_level": 1}))
    assert pool(base.model_copy(update={"sleep_level": 1}), OffloadProfile(name="p", kv_offload_gib=4))
    assert not pool(base.model_copy(update={"sleep_level": 1}), OffloadProfile(name="p", sleep_pool=False))
    assert not pool(base.model_copy(update={"sleep_level": 2}))  # level 2 keeps nothing in host RAM
    assert not pool(base)


def test_at_tensor_parallel_2_each_rank_fills_the_cache_with_its_half_experts_and_graphs_follow(tmp_path):
    from engine_patches.moe.sizing import expert_bytes, graph_tokens, slots_for_budget

    # Each rank holds every expert's half (the intermediate size split over two GPUs), and the engine
    # sizes a rank's cache from the experts that rank holds: 13.5 GiB holds 64 half experts a layer.
    profile = OffloadProfile(name="moe", moe_expert_offload=True, moe_gpu_cache_gib=13.5)
    config = ModelConfig(name="moe", model=_qwen3_moe(tmp_path), tensor_parallel_size=2, gpu_ids=[0, 1])
    rank_slots = slots_for_budget(
        13.5, num_experts=128, num_layers=48, one_expert_bytes=expert_bytes(2048, 768 // 2, 2), top_k=8
    )
    assert rank_slots == 64
    cmd = _build(config, profile)
    assert cmd.argv[cmd.argv.index("--max-cudagraph-capture-size") + 1] == str(graph_tokens(rank_slots, 8))


@pytest.mark.parametrize("flag", ["--enable-expert-parallel", "-ep", "--enable_eplb"])
def test_expert_offload_beside_a_flag_that_lets_vllm_place_the_experts_is_refused_naming_both(tmp_path, flag):
    # With expert parallelism vLLM splits whole experts between the GPUs itself and the plugin leaves
    # such layers on the GPU: the plan (experts in host memory, a small cache) would be wrong.
    profile = OffloadProfile(name="moe", moe_expert_offload=True, moe_gpu_cache_gib=4)
    config = ModelConfig(
        name="moe", model=_qwen3_moe(tmp_path), tensor_parallel_size=2, gpu_ids=[0, 1], extra_args=[flag]
    )
    with pytest.raises(Invalid, match=f"{flag} lets vLLM place the experts.*moe_expert_offload off") as refused:
        _build(config, profile)
    assert refused.value.detail["field"] == "extra_args"
    assert flag in " ".join(_build(config, None).argv)  # without the offload the flag is the user's to use
