"""What a config may hold: no control characters, a length limit on every text, numbers that are numbers.

Each refusal is a 422 on the field, with a message that does not repeat the value.
"""

from __future__ import annotations

import pytest
import yaml

MODEL = {"name": "m", "model": "org/model"}
PROFILE = {"name": "p", "kv_offload_gib": 4}
YAML = {"content-type": "application/yaml"}


def _refused_on(resp, field: str) -> str:
    assert resp.status_code == 422, resp.text[:300]
    errors = resp.json()["errors"]
    hits = [e for e in errors if field in [str(p) for p in e["loc"]]]
    assert hits, errors
    return hits[0]["msg"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": "org/mo\x00del"}, "model"),
        ({"model": "/models/a\x00b"}, "model"),
        ({"served_model_name": "served\x1bname"}, "served_model_name"),
        ({"env": {"HF_TOKEN": "hf_SECRET\x00tail"}}, "env"),
        ({"env": {"HF_TOKEN": "hf_SECRET\nLD_PRELOAD=/tmp/x.so"}}, "env"),
        ({"extra_args": ["--served-model-name", "a\x7fb"]}, "extra_args"),
        ({"dtype": "auto\r"}, "dtype"),
    ],
)
def test_control_characters_are_refused_when_a_config_is_written(client, change, field):
    msg = _refused_on(client.post("/api/models", json={**MODEL, **change}), field)
    assert "control character" in msg
    assert client.get("/api/models").json() == []
    assert client.post("/api/models", json=MODEL).status_code == 201
    resp = client.put("/api/models/m", json={**MODEL, **change})
    assert "control character" in _refused_on(resp, field)
    assert "hf_SECRET" not in resp.text
    assert client.get("/api/models/m").json()["model"] == "org/model"
    assert client.get("/api/models/m/command?validate=false").status_code == 200


def test_a_description_may_have_lines_but_no_other_control_characters(client):
    ok = client.post("/api/profiles", json={**PROFILE, "description": "for long prompts\n\tsecond line"})
    assert ok.status_code == 201
    bad = client.post("/api/profiles", json={**PROFILE, "name": "q", "description": "bell\x07"})
    assert "control character" in _refused_on(bad, "description")


def test_import_planner_and_lora_paths_refuse_them_too(client):
    doc = {"format": "vllm-manager", "version": 1, "models": [{**MODEL, "env": {"A": "x\x00y"}}]}
    resp = client.post("/api/import", content=yaml.safe_dump(doc), headers=YAML)  # written as "x\0y"
    assert resp.status_code == 422 and resp.json()["field"].startswith("models[0].env")
    assert "control character" in resp.json()["detail"]
    assert "control character" in _refused_on(client.post("/api/plan", json={"model": "/m\x00"}), "model")
    client.post("/api/models", json={**MODEL, "enable_lora": True})
    lora = client.post("/api/loras", json={"name": "a", "path": "/ad\x00apter", "base_config": "m"})
    assert "control character" in _refused_on(lora, "path")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": "n" * 1_000_000}, "name"),
        ({"model": "/m" * 5000}, "model"),
        ({"served_model_name": "s" * 300}, "served_model_name"),
        ({"env": {"BIG": "v" * 1_000_000}}, "env"),
        ({"env": {"N" * 300: "v"}}, "env"),
        ({"env": {f"V{i}": "1" for i in range(200)}}, "env"),
        ({"extra_args": ["--chat-template", "t" * 1_000_000]}, "extra_args"),
        ({"extra_args": ["--x"] * 300}, "extra_args"),
        ({"offload_profile": "p" * 100}, "offload_profile"),
    ],
)
def test_every_text_has_a_length_limit(client, change, field):
    resp = client.post("/api/models", json={**MODEL, **change})
    msg = _refused_on(resp, field)
    assert "at most" in msg
    assert len(resp.content) < 2000  # the value is not repeated back
    assert client.get("/api/models").json() == []


def test_long_arguments_that_fit_one_by_one_cannot_add_up_past_a_command_line(client):
    args = [f"--arg{i}={'x' * 15_000}" for i in range(20)]  # 300 kB: each fits, all together do not
    resp = client.post("/api/models", json={**MODEL, "extra_args": args})
    assert resp.status_code == 422 and "command line" in resp.text
    fits = client.post("/api/models", json={**MODEL, "extra_args": args[:5]})
    assert fits.status_code == 201
    command = client.get("/api/models/m/command?validate=false")
    assert command.status_code == 200 and len(command.json()["argv"]) > 5


def test_a_profile_description_has_a_limit(client):
    assert "at most" in _refused_on(
        client.post("/api/profiles", json={**PROFILE, "description": "d" * 5000}), "description"
    )


def test_the_limits_are_in_the_openapi_schema(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    model = schemas["ModelConfigCreate"]["properties"]
    assert model["model"]["maxLength"] == 4096 and "pattern" in model["model"]
    assert model["name"]["maxLength"] == 63
    assert model["extra_args"]["maxItems"] == 256 and model["extra_args"]["items"]["maxLength"] == 16384
    assert model["env"]["maxProperties"] == 128
    assert model["env"]["additionalProperties"]["maxLength"] == 16384
    assert model["gpu_ids"]["maxItems"] == 64 and model["gpu_ids"]["items"]["maximum"] == 255
    profile = schemas["OffloadProfileCreate"]["properties"]
    assert profile["description"]["maxLength"] == 4096
    assert schemas["PlanRequest"]["properties"]["model"]["maxLength"] == 4096


@pytest.mark.parametrize("gpu_ids", [[256], [-1], [0, 0], list(range(65)), [10**20]])
def test_gpu_ids_are_ids_a_machine_can_have(client, gpu_ids):
    _refused_on(client.post("/api/models", json={**MODEL, "gpu_ids": gpu_ids}), "gpu_ids")


def test_a_worker_start_checks_its_gpus_and_port(client):
    client.post("/api/models", json=MODEL)
    for body in ({"gpus": [300]}, {"gpus": [1, 1]}, {"port": True}, {"gpus": [True]}):
        resp = client.post("/api/workers", json={"model": "m", **body})
        assert resp.status_code == 422, (body, resp.text)
    assert client.get("/api/workers").json() == []


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/api/profiles",
            {**PROFILE, "kv_offload_gib": None, "lora_cpu_pooling": True, "lora_pool_gib": True},
            "lora_pool_gib",
        ),
        ("/api/profiles", {**PROFILE, "kv_offload_gib": True}, "kv_offload_gib"),
        ("/api/profiles", {"name": "p", "kv_offload_num_cpu_blocks": True}, "kv_offload_num_cpu_blocks"),
        ("/api/models", {**MODEL, "max_model_len": True}, "max_model_len"),
        ("/api/models", {**MODEL, "gpu_memory_utilization": True}, "gpu_memory_utilization"),
        ("/api/models", {**MODEL, "tensor_parallel_size": True}, "tensor_parallel_size"),
        ("/api/models", {**MODEL, "gpu_ids": [True]}, "gpu_ids"),
        ("/api/plan", {"model": "/m", "tensor_parallel_size": True}, "tensor_parallel_size"),
        ("/api/plan", {"model": "/m", "kv_offload_gib": False}, "kv_offload_gib"),
    ],
)
def test_true_and_false_are_not_numbers(client, path, body, field):
    assert "not true or false" in _refused_on(client.post(path, json=body), field)


def test_half_a_utf16_pair_from_yaml_is_refused_not_stored(client):
    text = 'format: vllm-manager\nversion: 1\nmodels: [{name: m, model: "org/\\ud800x"}]\n'
    resp = client.post("/api/import", content=text, headers=YAML)
    assert resp.status_code == 422 and resp.json()["field"] == "models[0].model"
    assert client.get("/api/models").json() == []
