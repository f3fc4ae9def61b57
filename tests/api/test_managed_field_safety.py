"""The values of the fields the manager writes into an engine's argv (dtype, kv_cache_dtype, quantization,
served_model_name, model, ...) never load code, and no size a config gives makes the manager build
anything that large: refused on write with a message naming the field, and refused again on preview,
start and /v1 for a config stored before these rules (or straight into the database)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.db import session
from manager.planner.gpus import GPU
from manager.schemas.model_config import ModelConfig

BASE = {"name": "m", "model": "org/model"}
# vLLM's parser reads an element that starts with '-' and holds a '.' as one key of a JSON flag, and takes the
# next element as its value: written as `--kv-cache-dtype VALUE`, this value set the compilation config's
# inductor_passes, which vLLM imports as it reads them.
ATTACK = {
    **BASE,
    "name": "attack",
    "kv_cache_dtype": "-cc.inductor_passes",
    "extra_args": [json.dumps({"x": "planted.run"}), "auto"],
}


@pytest.fixture
def planted(tmp_path, monkeypatch) -> Path:
    """A module on the engines' PYTHONPATH whose import leaves a marker file; the marker's path."""
    folder = tmp_path / "plant"
    folder.mkdir()
    marker = tmp_path / "imported"
    (folder / "planted.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n\ndef run(graph):\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return marker


@pytest.fixture
def parsing_engine(settings, tmp_path) -> Iterator[TestClient]:
    """A manager whose engine interpreter, asked to start an engine, only reads the argv with vLLM's parser
    (what the API server does first) and exits; anything else (the preview's check) runs as Python."""
    python = tmp_path / "engine-python"
    parse = (
        "import sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
    )
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = vllm.entrypoints.openai.api_server ]; then\n'
        f"  shift 2; exec {sys.executable} -c '{parse}' \"$@\"\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    engine_settings = settings.model_copy(update={"engine_python": str(python), "worker_ports": "18370-18380"})
    with TestClient(create_app(engine_settings)) as c:
        yield c
        for worker in c.get("/api/workers").json():
            c.post(f"/api/workers/{worker['id']}/stop")


def _store_directly(client: TestClient, config: ModelConfig) -> None:
    """Write a config as an older manager (or anyone with the database file) could have stored it."""
    with session(cast(FastAPI, client.app).state.runtime.engine) as db:
        db.add(config)
        db.commit()


def _start(client: TestClient, name: str) -> int:
    """Ask for a start; one the manager lets through is waited for until its engine has read its argv."""
    started = client.post("/api/workers", json={"model": name})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(w["state"] == "starting" for w in client.get("/api/workers").json()):
        time.sleep(0.5)
    return started.status_code


def test_a_managed_field_that_would_plant_a_flag_is_refused_and_nothing_is_imported(parsing_engine, planted):
    c = parsing_engine
    stored = c.post("/api/models", json=ATTACK)
    assert stored.status_code == 422, stored.text
    assert stored.json()["detail"].startswith("kv_cache_dtype: ")
    assert "starts with '-'" in stored.json()["detail"]
    assert c.get("/api/models").json() == []
    assert c.get("/api/models/attack/command").status_code == 404
    assert c.post("/api/workers", json={"model": "attack"}).status_code == 404
    assert not planted.exists()


def test_a_stored_config_with_such_a_value_is_listed_and_refused_on_preview_and_start(parsing_engine, planted):
    c = parsing_engine
    _store_directly(c, ModelConfig(**{**ATTACK, "name": "old"}))
    assert [m["name"] for m in c.get("/api/models").json()] == ["old"]  # never lost, and shown as it is
    preview = c.get("/api/models/old/command")
    assert preview.status_code == 422
    assert preview.json()["field"] == "kv_cache_dtype" and "starts with '-'" in preview.json()["detail"]
    assert _start(c, "old") == 422
    assert c.get("/api/workers").json() == []
    assert not planted.exists()


@pytest.mark.parametrize(
    ("fields", "named", "says"),
    [
        ({"dtype": "-cc.inductor_passes"}, "dtype", "starts with '-'"),
        ({"quantization": "-O.inductor_passes.x"}, "quantization", "starts with '-'"),
        ({"served_model_name": "-cc.inductor_passes"}, "served_model_name", "starts with '-'"),
        ({"model": "-cc.inductor_passes"}, "model", "give its full path"),
        ({"dtype": "bf16"}, "dtype", "must be one of: auto, half, float16, bfloat16, float, float32"),
        ({"kv_cache_dtype": "fp7"}, "kv_cache_dtype", "must be one of: auto, float16, bfloat16, fp8,"),
        ({"quantization": "my_quant"}, "quantization", "must be one of: awq,"),
        ({"quantization": ""}, "quantization", "leave it out for none"),
        ({"max_lora_rank": 12}, "max_lora_rank", "must be one of: 1, 8, 16, 32, 64, 128, 256, 320, 512"),
    ],
)
def test_each_refused_value_is_a_422_naming_its_field(client, fields, named, says):
    resp = client.post("/api/models", json={**BASE, **fields})
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"].startswith(f"{named}: ") and says in resp.json()["detail"]
    assert client.get("/api/models").json() == []


def test_the_same_values_are_refused_by_a_replace_an_import_and_the_form(client):
    assert client.post("/api/models", json=BASE).status_code == 201
    replaced = client.put("/api/models/m", json={**BASE, "served_model_name": "-cc.inductor_passes"})
    assert replaced.status_code == 422 and replaced.json()["detail"].startswith("served_model_name: ")
    doc = {"format": "vllm-manager", "version": 1, "models": [{**BASE, "name": "n", "dtype": "-cc.x"}]}
    imported = client.post("/api/import", json=doc)
    assert imported.status_code == 422 and "models[0].dtype" in imported.json()["detail"]
    form = client.post("/ui/models/new", data={"name": "f", "model": "org/model", "kv_cache_dtype": "-cc.x"})
    assert "starts with &#39;-&#39;" in form.text or "starts with '-'" in form.text
    assert [m["name"] for m in client.get("/api/models").json()] == ["m"]
    assert client.get("/api/models/m").json()["served_model_name"] is None


def test_every_value_vllm_takes_is_stored_and_written_as_one_element(client):
    fields = {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", "quantization": "compressed-tensors"}
    created = client.post("/api/models", json={**BASE, **fields, "served_model_name": "my.model", "max_lora_rank": 64})
    assert created.status_code == 201, created.text
    argv = client.get("/api/models/m/command", params={"validate": False}).json()["argv"]
    assert "--dtype=bfloat16" in argv and "--kv-cache-dtype=fp8_e4m3" in argv
    assert "--quantization=compressed-tensors" in argv and "--served-model-name=my.model" in argv


def test_a_tensor_parallel_size_beyond_any_cluster_is_refused(client):
    huge = client.post("/api/models", json={**BASE, "tensor_parallel_size": 2147483647})
    assert huge.status_code == 422
    assert huge.json()["detail"] == "tensor_parallel_size: Input should be less than or equal to 1024"
    piped = client.post("/api/models", json={**BASE, "tensor_parallel_size": 8, "extra_args": ["-pp", "256"]})
    assert piped.status_code == 422
    assert "tensor_parallel_size 8 x pipeline parallel size 256 needs 2048 GPUs" in piped.json()["detail"]
    spelled = client.post("/api/models", json={**BASE, "extra_args": ["--pipeline_parallel=2048"]})
    assert spelled.status_code == 422 and "needs 2048 GPUs" in spelled.json()["detail"]
    fits = client.post("/api/models", json={**BASE, "tensor_parallel_size": 8, "extra_args": ["-pp=4"]})
    assert fits.status_code == 201, fits.text


def test_a_start_needing_more_gpus_than_the_machine_has_is_refused(parsing_engine, monkeypatch):
    c = parsing_engine
    monkeypatch.setattr("manager.supervisor.supervisor.detect_gpu", lambda: GPU("H100", 80 << 30, "NVML", 2))
    created = c.post("/api/models", json={**BASE, "tensor_parallel_size": 2, "extra_args": ["-pp", "2"]})
    assert created.status_code == 201
    started = c.post("/api/workers", json={"model": "m"})
    assert started.status_code == 422
    assert started.json()["detail"].startswith("m needs 4 GPUs (tensor x pipeline x data parallel size) and this")
    assert c.get("/api/workers").json() == []


def test_a_huge_tensor_parallel_size_in_the_database_is_refused_cleanly(parsing_engine):
    c = parsing_engine
    _store_directly(c, ModelConfig(name="huge", model="org/model", tensor_parallel_size=2147483647))
    assert c.get("/api/models/huge").json()["tensor_parallel_size"] == 2147483647
    assert c.get("/").status_code == 200 and "huge" in c.get("/").text
    preview = c.get("/api/models/huge/command")
    assert preview.status_code == 422 and preview.json()["field"] == "tensor_parallel_size"
    assert "needs 2147483647 GPUs for one engine; the most the manager takes is 1024" in preview.json()["detail"]
    answer = c.post("/v1/completions", json={"model": "huge", "prompt": "hi", "max_tokens": 1})
    assert 400 <= answer.status_code < 600 and answer.status_code != 500
    assert "the most the manager takes is 1024" in answer.json()["error"]["message"]
    assert c.get("/api/workers").json() == []
