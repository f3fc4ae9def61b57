"""Reading vLLM 0.32's own KV figures from an engine log."""

from __future__ import annotations

import pytest

from manager.planner.engine_report import compare, parse_engine_kv_report
from manager.planner.records import EngineKVReport

# Lines as vLLM 0.32 prints them (v1/core/kv_cache_utils.py, v1/worker/gpu_worker.py).
GPU_LOG = """\
(EngineCore pid=812) INFO 11-21 10:00:01 [gpu_model_runner.py:5150] Model loading took 15.63 GiB memory and 12.5 seconds
(EngineCore pid=812) INFO 11-21 10:00:20 [gpu_worker.py:760] Available KV cache memory: 4.59 GiB
(EngineCore pid=812) INFO 11-21 10:00:20 [kv_cache_utils.py:2327] GPU KV cache size: 50,128 tokens, Maximum concurrency for 52,000 tokens per request: 0.96x
"""

CPU_LOG = """\
INFO 11-21 10:00:01 [cpu_worker.py:260] Explicitly set (1.0/23.47) GiB for KV cache on node 0.
INFO 11-21 10:00:01 [kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 4,096 tokens per request: 512.00x
"""


def test_gpu_log_gives_tokens_concurrency_and_memory():
    report = parse_engine_kv_report(GPU_LOG)
    assert report == EngineKVReport(
        device="GPU",
        kv_cache_tokens=50128,
        max_model_len=52000,
        max_concurrency=0.96,
        available_kv_gib=4.59,
        model_loading_gib=15.63,
    )


def test_cpu_log_gives_the_explicit_kv_size():
    report = parse_engine_kv_report(CPU_LOG)
    assert report.device == "CPU"
    assert report.kv_cache_tokens == 2_097_152
    assert report.available_kv_gib == 1.0
    assert report.max_concurrency == 512.0


def test_a_restarted_engine_reports_its_latest_figures():
    second = GPU_LOG.replace("50,128", "61,040").replace("0.96x", "1.17x")
    report = parse_engine_kv_report(GPU_LOG + second)
    assert report.kv_cache_tokens == 61040 and report.max_concurrency == 1.17


def test_log_without_report_leaves_fields_empty():
    assert parse_engine_kv_report("INFO starting\n").kv_cache_tokens is None


def test_comparison_error_is_relative_to_vllm(model_config):
    from manager.planner.gpus import gpu_from_catalogue
    from manager.planner.host import planned_host
    from manager.planner.plan import make_plan
    from manager.planner.records import PlanRequest

    plan = make_plan(
        PlanRequest(model="x", hf_config=model_config("Llama-3.1-8B-Instruct"), max_model_len=8192, gpu="rtx-4090"),
        gpu=gpu_from_catalogue("rtx-4090"),
        host=planned_host(64),
    )
    reported = EngineKVReport(kv_cache_tokens=plan.kv_cache_tokens * 2, max_concurrency=1.0)
    result = compare(plan, reported)
    assert result.error_percent == pytest.approx(-50.0)
    assert compare(plan, EngineKVReport()) is None
