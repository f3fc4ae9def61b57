"""The launch command: built from a config and checked by the real vLLM 0.32.0 parser."""

from __future__ import annotations

import json

import pytest

from manager.launch.validation import validate_engine_argv

BASE = {"model": "org/none", "gpu_memory_utilization": 0.5, "max_model_len": 4096}


def _command(client, name):
    return client.get(f"/api/models/{name}/command")


REPRESENTATIVE = {
    "kv-offload": (
        {**BASE, "offload_profile": "kv"},
        ["--kv-offloading-size=2.5", "--kv-offloading-backend=native"],
    ),
    "kv-offload-arc": ({**BASE, "offload_profile": "kv-arc"}, ["--kv-transfer-config"]),
    "lora": (
        {**BASE, "enable_lora": True, "max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 8},
        ["--enable-lora", "--max-loras=4", "--max-lora-rank=16", "--max-cpu-loras=8"],
    ),
    "fp8-kv": (
        {**BASE, "kv_cache_dtype": "fp8", "max_num_seqs": 8, "enforce_eager": True},
        ["--max-num-seqs=8", "--kv-cache-dtype=fp8", "--enforce-eager"],
    ),
    "tp2": ({**BASE, "tensor_parallel_size": 2, "gpu_ids": [2, 3]}, ["--tensor-parallel-size=2"]),
    "extra": (
        {
            **BASE,
            "extra_args": ["--enable-chunked-prefill", "--max-num-batched-tokens", "2048"],
            "enable_prefix_caching": False,
        },
        [
            "--no-enable-prefix-caching",
            "--disable-access-log-for-endpoints=/health,/v1/models,/metrics,/is_sleeping",
            "--enable-chunked-prefill",
            "--max-num-batched-tokens",
            "2048",
        ],  # fmt: skip
    ),
}


@pytest.mark.parametrize("case", sorted(REPRESENTATIVE))
def test_representative_configs_pass_vllms_parser(client, case):
    client.post("/api/profiles", json={"name": "kv", "kv_offload_gib": 2.5})
    client.post("/api/profiles", json={"name": "kv-arc", "kv_offload_gib": 1, "kv_eviction_policy": "arc"})
    body, expected = REPRESENTATIVE[case]
    assert client.post("/api/models", json={"name": case, **body}).status_code == 201
    resp = _command(client, case)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert isinstance(data["argv"], list) and all(isinstance(a, str) for a in data["argv"])
    assert data["argv"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    argv_text = " ".join(data["argv"])
    assert " ".join(expected) in argv_text
    assert data["validation"]["status"] == "valid", data["validation"]
    assert data["validation"]["vllm_version"] == "0.32.0"
    if case == "kv-offload-arc":
        extra = json.loads(data["argv"][data["argv"].index("--kv-transfer-config") + 1])
        assert extra["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1 << 30, "eviction_policy": "arc"}
    if case == "tp2":
        assert data["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    if case == "lora":
        assert data["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "offload_patches" in data["env"]["VLLM_PLUGINS"].split(",")


def test_vllm_rejection_comes_back_as_422_with_its_message(client):
    # A value the manager passes on as it is, and vLLM's parser refuses.
    client.post("/api/models", json={**BASE, "name": "bad", "extra_args": ["--block-size", "sixteen"]})
    resp = _command(client, "bad")
    assert resp.status_code == 422
    detail = resp.json()["detail"]
    assert "--block-size" in detail and "sixteen" in detail  # vLLM's own words
    assert resp.json()["argv"][-2:] == ["--block-size", "sixteen"]


def test_unknown_extra_flag_is_rejected_by_vllm(client):
    client.post("/api/models", json={**BASE, "name": "typo", "extra_args": ["--max-num-batched-tokenz", "4"]})
    resp = _command(client, "typo")
    assert resp.status_code == 422
    assert "--max-num-batched-tokenz" in resp.json()["detail"]


def test_validation_skipped_without_vllm(client, settings, tmp_path):
    from fastapi.testclient import TestClient

    from manager.app import create_app

    no_vllm = settings.model_copy(update={"engine_python": "/usr/bin/python3"})
    with TestClient(create_app(no_vllm)) as c:
        c.post("/api/models", json={**BASE, "name": "x"})
        data = c.get("/api/models/x/command").json()
    assert data["validation"]["status"] == "skipped"
    assert "not importable" in data["validation"]["message"]


def test_num_cpu_blocks_converted_with_the_models_page_size(client, tiny_llama):
    # The tiny Llama: 2 layers x 2 KV heads x head_dim 32 x (K and V) x 2 bytes = 512 bytes per token
    # per layer pair; a 16-token block over both layers is 16 x 2 x 2 x 32 x 2 x 2 = 8192 bytes.
    client.post("/api/profiles", json={"name": "kv-blocks", "kv_offload_num_cpu_blocks": 50000})
    client.post("/api/models", json={**BASE, "name": "tiny", "model": str(tiny_llama), "offload_profile": "kv-blocks"})
    data = _command(client, "tiny").json()
    argv = data["argv"]
    gib = float(next(a for a in argv if a.startswith("--kv-offloading-size=")).split("=", 1)[1])
    assert round(gib * (1 << 30)) == 50000 * 8192
    assert "num_cpu_blocks" in data["notes"][0] and "does not raise max_model_len" in data["notes"][0]
    assert data["validation"]["status"] == "valid"


def test_num_cpu_blocks_refused_when_model_config_unreadable(client):
    client.post("/api/profiles", json={"name": "kv-blocks", "kv_offload_num_cpu_blocks": 50000})
    client.post(
        "/api/models", json={**BASE, "name": "far", "model": "someorg/not-in-cache", "offload_profile": "kv-blocks"}
    )
    resp = _command(client, "far")
    assert resp.status_code == 422
    assert "kv_offload_gib" in resp.json()["detail"] and "cpu_bytes_to_use" in resp.json()["detail"]


def test_validation_is_run_by_the_engine_interpreter(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho \'{"status": "valid", "message": "from fake"}\'\n')
    fake.chmod(0o755)
    assert validate_engine_argv(str(fake), ["--model", "x"]).message == "from fake"
