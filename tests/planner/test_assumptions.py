"""A plan says what it assumed vLLM decides, and follows the flags of a stored config that change it."""

from __future__ import annotations

import json
from typing import Any

import typer
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from manager.cli_plan import plan as plan_command
from manager.deps import get_supervisor
from manager.launch.preflight import HostClaims, engine_choices, plan_request
from manager.planner import PlanRequest, make_plan
from manager.planner.host import HostMemory
from manager.routes.plan import router
from manager.schemas.model_config import ModelConfig
from tests.planner.conftest import load_config

G = 1 << 30
HOST = HostMemory(128 * G, 120 * G, 64 * G, 64 * G, None)
LMCACHE = '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'


def _gemma(**fields: Any) -> PlanRequest:
    values: dict[str, Any] = {"gpu": "h100-80", "max_model_len": 16384, "kv_cache_memory_gib": 24} | fields
    return PlanRequest(model="gemma", hf_config=load_config("gemma-3-12b-it"), **values)


def test_extra_args_that_change_the_kv_cache_are_read_as_vllm_reads_them():
    argv = [
        "--max_num_batched_tokens=4096",
        "--no-async-scheduling",
        "--kv-transfer-config",
        LMCACHE,
        "--performance-mode",
        "throughput",
        "--max-num-batched-tokens",
        "16384",  # the last one given wins, as in argparse
        "--disable-hybrid-kv-cache-manager",
        "--no_disable_hybrid_kv_cache_manager",
    ]
    assert engine_choices(argv) == {
        "max_num_batched_tokens": 16384,
        "async_scheduling": False,
        "disable_hybrid_kv_cache_manager": False,
        "kv_transfer_config": json.loads(LMCACHE),
        "performance_mode": "throughput",
    }
    # What vLLM's own check refuses is not the plan's to read.
    assert engine_choices(["--max-num-batched-tokens", "many", "--kv-transfer-config", "[1]"]) == {}


def test_a_connector_that_turns_the_hybrid_manager_off_costs_gemma_its_windows():
    hybrid = make_plan(_gemma(max_model_len=32768), host=HOST)
    config = ModelConfig(name="g", model="gemma", max_model_len=32768, extra_args=["--kv-transfer-config", LMCACHE])
    request = plan_request(config, None, "h100-80").model_copy(
        update={"hf_config": load_config("gemma-3-12b-it"), "kv_cache_memory_gib": 24}
    )
    full = make_plan(request, host=HOST)
    assert hybrid.assumptions.hybrid_kv_cache_manager and not full.assumptions.hybrid_kv_cache_manager
    assert "LMCacheConnectorV1" in full.assumptions.hybrid_reason
    # 48 full layers instead of 8 (+ 40 windows of 1,023 + 16,384 tokens): fewer tokens in the same memory.
    assert full.kv_cache_tokens < hybrid.kv_cache_tokens * 0.7
    assert full.line("kv_manager").value == "off" and hybrid.line("kv_manager").value == "on"


def test_fewer_tokens_in_flight_leave_sliding_layers_less_to_keep():
    async_plan = make_plan(_gemma(), host=HOST)
    sync_plan = make_plan(_gemma(async_scheduling=False), host=HOST)
    assert async_plan.assumptions.in_flight_tokens == 2 * 8192
    assert sync_plan.assumptions.in_flight_tokens == 8192
    assert sync_plan.assumptions.sliding_window_tokens == 1023 + 8192
    assert sync_plan.kv_cache_tokens > async_plan.kv_cache_tokens
    assert sync_plan.line("sliding_window_tokens").value == 1023 + 8192


def test_the_cli_prints_what_it_assumed(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_config("gpt-oss-20b")))
    app = typer.Typer()
    app.command()(plan_command)
    result = CliRunner().invoke(
        app, [str(tmp_path), "--gpu", "h100-80", "--max-model-len", "32768", "--host-ram-gib", "128"]
    )
    assert "assumed: hybrid KV cache manager on (vLLM's default)" in result.output
    assert "2 batches of 8,192 tokens in flight" in result.output
    assert "a sliding-window layer keeps 16,511 tokens" in result.output  # 128 - 1 + 16,384
    off = CliRunner().invoke(
        app,
        [str(tmp_path), "--gpu", "h100-80", "--max-model-len", "32768", "--host-ram-gib", "128"]
        + ["--kv-transfer-config", LMCACHE],
    )
    assert "hybrid KV cache manager off (vLLM turns it off: the KV connector LMCacheConnectorV1" in off.output
    bad = CliRunner().invoke(app, [str(tmp_path), "--kv-transfer-config", "nonsense"])
    assert bad.exit_code == 2 and "not a JSON object" in bad.output


def test_the_api_answers_with_the_assumptions():
    app = FastAPI()
    app.include_router(router)
    app.dependency_overrides[get_supervisor] = lambda: type("NoWorkers", (), {"host_claims": lambda s: HostClaims()})()
    body = _gemma(max_num_batched_tokens=2048).model_dump()
    answer = TestClient(app).post("/api/plan", json=body | {"host_ram_gib": 128}).json()
    assumed = answer["assumptions"]
    assert assumed["max_num_batched_tokens"] == 2048 and assumed["batched_reason"] == "as given"
    assert assumed["in_flight_tokens"] == 4096 and assumed["hybrid_kv_cache_manager"] is True
    assert assumed["sliding_window_tokens"] == 1023 + 4096
