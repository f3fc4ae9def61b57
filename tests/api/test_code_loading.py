"""Code-loading settings through the API: refused on write and import, and on start and preview of a
config stored before the rule (or under the opt-out), which stays listed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import yaml
from fastapi.testclient import TestClient

from manager.app import create_app

BASE = {"name": "m", "model": "org/model", "gpu_ids": [0]}
PASSES = json.dumps({"inductor_passes": {"p": "my_passes.fuse"}})
YAML = {"Content-Type": "application/yaml"}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"env": {"VLLM_LOGGING_CONFIG_PATH": "/tmp/logging.json"}}, "VLLM_LOGGING_CONFIG_PATH"),
        ({"env": {"NCCL_NET_PLUGIN": "/tmp/libnet.so"}}, "NCCL_NET_PLUGIN"),
        ({"env": {"NCCL_TUNER_PLUGIN": "/tmp/libtuner.so"}}, "NCCL_TUNER_PLUGIN"),
        ({"env": {"PATH": "/tmp/bin"}}, "PATH"),
        ({"env": {"CC": "/tmp/cc"}}, "CC"),
        ({"env": {"SOMETHING_ELSE": "1"}}, "SOMETHING_ELSE"),
        ({"extra_args": ["--compilation-config", PASSES]}, "inductor_passes"),
        ({"extra_args": ["-O", PASSES]}, "inductor_passes"),
        ({"extra_args": ["-O.inductor_passes.p", "my_passes.fuse"]}, "inductor_passes"),
        ({"extra_args": ["--kv-transfer-config.kv_connector_module_path", "my_pkg"]}, "kv_connector_module_path"),
        ({"extra_args": ["--speculative-config", '{"model": "my_pkg.Proposer"}']}, "model"),
        ({"extra_args": ["--hf-overrides", '{"rope_scaling": {"factor": 4.0}']}, "--hf-overrides is not valid JSON"),
        ({"extra_args": ["--distributed-executor-backend", "my_pkg.MyExecutor"]}, "executor class path"),
        ({"extra_args": ["--distributed-executor-backend=my_pkg.MyExecutor"]}, "executor class path"),
        ({"extra_args": ["--distributed-executor"]}, "executor class path"),
    ],
)
def test_each_code_loading_setting_is_a_422_that_names_it(client, fields, named):
    resp = client.post("/api/models", json={**BASE, **fields})
    assert resp.status_code == 422, resp.text
    assert named in resp.json()["detail"]
    assert resp.json()["field"] == ("env" if "env" in fields else "extra_args")
    assert client.get("/api/models").json() == []


def test_a_typical_config_is_stored(client):
    typical = {
        **BASE,
        "env": {
            "HF_TOKEN": "hf_x",
            "CUDA_VISIBLE_DEVICES": "0",
            "NCCL_DEBUG": "INFO",
            "VLLM_ATTENTION_BACKEND": "FLASHINFER",
        },
        "extra_args": [
            "-O3",
            "--compilation-config",
            '{"cudagraph_capture_sizes": [1, 2, 4]}',
            "--hf-overrides",
            '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}',
        ],
    }
    created = client.post("/api/models", json=typical)
    assert created.status_code == 201, created.text
    assert created.json()["extra_args"] == typical["extra_args"]


@pytest.mark.parametrize("args", [["--distributed-executor-backend", "ray"], ["--distributed-executor-backend=mp"]])
def test_one_of_vllms_own_executors_is_not_code_loading(client, args):
    created = client.post("/api/models", json={**BASE, "extra_args": args})
    assert created.status_code == 201, created.text
    preview = client.get("/api/models/m/command")
    assert preview.status_code == 200, preview.text


def test_the_opt_out_stores_them(settings):
    allowed = settings.model_copy(update={"allow_code_flags": True})
    with TestClient(create_app(allowed)) as c:
        resp = c.post("/api/models", json={**BASE, "env": {"PATH": "/opt/bin"}, "extra_args": ["-cc", PASSES]})
        assert resp.status_code == 201, resp.text


def test_an_import_names_the_config_and_the_setting(client):
    doc = {"format": "vllm-manager", "version": 1, "models": [BASE, {**BASE, "name": "n", "env": {"CC": "/tmp/cc"}}]}
    resp = client.post("/api/import", content=yaml.safe_dump(doc), headers=YAML)
    assert resp.status_code == 422
    assert resp.json()["detail"].startswith("models[1] (n): env: CC is refused")
    assert client.get("/api/models").json() == []  # nothing of the file is kept


@pytest.fixture
def stored_under_opt_out(settings, tmp_path) -> Iterator[TestClient]:
    """A config written while VLLM_MANAGER_ALLOW_CODE_FLAGS=1, and the manager restarted without it.

    Its engine interpreter only sleeps: a start the rule failed to stop would not run vLLM."""
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nexec sleep 600\n")
    sleeper.chmod(0o755)
    plain = settings.model_copy(update={"engine_python": str(sleeper), "worker_ports": "18350-18360"})
    code = {**BASE, "name": "old", "env": {"NCCL_NET_PLUGIN": "/opt/libnet.so"}, "extra_args": ["-cc", PASSES]}
    env_only = {**BASE, "name": "old-env", "gpu_ids": [1], "env": {"PATH": "/opt/bin"}}
    with TestClient(create_app(plain.model_copy(update={"allow_code_flags": True}))) as c:
        assert c.post("/api/models", json=code).status_code == 201
        assert c.post("/api/models", json=env_only).status_code == 201
    with TestClient(create_app(plain)) as c:
        yield c
        for worker in c.get("/api/workers").json():
            c.post(f"/api/workers/{worker['id']}/stop")


def test_a_stored_config_that_the_rules_refuse_stays_listed_and_editable(stored_under_opt_out):
    c = stored_under_opt_out
    assert [m["name"] for m in c.get("/api/models").json()] == ["old", "old-env"]
    assert c.get("/api/models/old").json()["env"] == {"NCCL_NET_PLUGIN": "/opt/libnet.so"}
    assert c.get("/models").status_code == 200 and "old" in c.get("/models").text
    assert c.get("/models/old").status_code == 200
    fixed = c.put("/api/models/old", json={**BASE, "env": {}, "extra_args": ["-O3"]})
    assert fixed.status_code == 200


def test_starting_or_previewing_it_is_refused_with_the_reason(stored_under_opt_out):
    c = stored_under_opt_out
    started = c.post("/api/workers", json={"model": "old"})
    assert started.status_code == 422
    assert "extra_args: -cc sets inductor_passes" in started.json()["detail"]
    assert "VLLM_MANAGER_ALLOW_CODE_FLAGS=1" in started.json()["detail"]
    assert c.get("/api/workers").json() == []
    preview = c.get("/api/models/old/command")
    assert preview.status_code == 422 and "inductor_passes" in preview.json()["detail"]
    page = c.get("/ui/models/old/command")
    assert page.status_code == 200 and "inductor_passes" in page.text


def test_a_refused_variable_is_named_at_start_too(stored_under_opt_out):
    started = stored_under_opt_out.post("/api/workers", json={"model": "old-env"})
    assert started.status_code == 422
    assert started.json()["detail"].startswith("env: PATH is refused because")
