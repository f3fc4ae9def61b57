"""POST /api/plan and GET /api/plan/gpus through FastAPI's test client (thin: the logic is tested above)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from manager import error_responses
from manager.deps import get_supervisor
from manager.launch.preflight import HostClaims
from manager.routes.plan import router
from tests.planner.conftest import load_config


class NoWorkers:
    """The supervisor of a manager with no workers: nothing holds host RAM."""

    def host_claims(self) -> HostClaims:
        return HostClaims()


def _client() -> TestClient:
    app = FastAPI()
    error_responses.install(app)  # the manager's errors (the hub's answers among them) as its app answers them
    app.include_router(router)
    app.dependency_overrides[get_supervisor] = NoWorkers
    return TestClient(app)


def test_post_plan_returns_lines_and_verdict():
    body = {
        "model": "Qwen3-Coder",
        "hf_config": load_config("Qwen3-Coder-30B-A3B-Instruct-AWQ"),
        "max_model_len": 52000,
        "gpu_memory_utilization": 0.88,
        "gpu": "rtx-4090",
        "host_ram_gib": 128,
        "kv_offload_gib": 32,
    }
    response = _client().post("/api/plan", json=body)
    assert response.status_code == 200
    plan = response.json()
    assert plan["verdict"]["fits"] is False
    assert plan["prefix_cache_tokens_from_offload"] > 0
    keys = {line["key"] for line in plan["lines"]}
    assert {"kv_budget", "max_context", "offload_prefix_tokens", "way_fp8_kv"} <= keys
    assert all(line["unit"] and line["explanation"] for line in plan["lines"])


def test_a_model_folder_that_is_not_there_is_a_422_with_the_reason(tmp_path):
    response = _client().post("/api/plan", json={"model": str(tmp_path / "nothing"), "gpu": "h100-80"})
    assert response.status_code == 422
    assert "neither a local folder nor in the Hugging Face cache" in response.json()["detail"]


def test_a_hub_id_the_hub_does_not_have_is_a_404_that_says_so(tmp_path, monkeypatch, test_hub):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", test_hub.url)
    response = _client().post("/api/plan", json={"model": "nobody/nothing", "gpu": "h100-80"})
    assert response.status_code == 404
    assert "no model nobody/nothing on " + test_hub.url in response.json()["detail"]


def test_bad_settings_are_rejected_by_validation():
    response = _client().post("/api/plan", json={"model": "x", "gpu_memory_utilization": 1.5})
    assert response.status_code == 422


def test_gpu_list_has_detection_and_catalogue():
    data = _client().get("/api/plan/gpus").json()
    assert "available" in data["detected"]
    keys = {g["key"] for g in data["catalogue"]}
    assert {"rtx-4090", "h100-80", "cpu"} <= keys


def test_typos_and_absurd_numbers_are_422_not_500(tmp_path):
    from fastapi.testclient import TestClient

    from manager.app import create_app
    from manager.settings import Settings

    with TestClient(create_app(Settings(data_dir=tmp_path / "d"))) as c:
        folder = tmp_path / "m"
        folder.mkdir()
        (folder / "config.json").write_text(
            '{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 128}'
        )
        for body in (
            {"model": str(folder), "gpu": "nope"},
            {"model": str(folder), "gpu": "h100-80"},
            {"model": str(folder), "gpu": "h100-80", "kv_offload_gib": 1e308},
        ):
            resp = c.post("/api/plan", json=body)
            assert resp.status_code == 422, (body, resp.text)


def test_a_config_with_more_layers_than_any_model_is_a_422_not_a_list_that_size():
    body = {
        "model": "deep",
        "hf_config": {**load_config("Qwen3-Coder-30B-A3B-Instruct-AWQ"), "num_hidden_layers": 10_000_000},
        "gpu": "rtx-4090",
    }
    response = _client().post("/api/plan", json=body)
    assert response.status_code == 422
    assert "num_hidden_layers = 10000000" in response.json()["detail"] and "1 to 4096" in response.json()["detail"]
