"""The dashboard's routes through the real app (TestClient): pages, forms, metrics endpoints."""

from __future__ import annotations

import time

import psutil
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from manager.app import create_app
from manager.db import make_engine, migrate, session
from manager.services import tokens


def _first_sample(client: TestClient, samples: int = 1) -> dict:
    """The collector samples once a second from startup; wait until it has ``samples`` of them."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        resp = client.get("/api/metrics")
        if resp.status_code == 200 and resp.json()["seq"] >= samples:
            return resp.json()
        time.sleep(0.2)
    raise AssertionError("the metrics collector took no sample in 10 s")


def _tiny_config(folder, name: str = "tiny") -> dict:
    return {"name": name, "model": str(folder), "gpu_memory_utilization": 0.2,
            "max_model_len": 1024, "extra_args": ["--load-format", "dummy"]}  # fmt: skip


def test_metrics_json_and_prometheus_show_the_same_machine(client):
    snap = _first_sample(client)
    assert snap["host"]["ram_total_bytes"] == psutil.virtual_memory().total
    resp = client.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    values = {s.name: s.value for family in text_string_to_metric_families(resp.text) for s in family.samples}
    assert values["vllm_manager_gpu_available"] == (1.0 if snap["gpu"]["available"] else 0.0)
    assert values["vllm_manager_host_memory_total_bytes"] == psutil.virtual_memory().total


def test_history_returns_points_per_series_and_explains_bad_queries(client):
    _first_sample(client, samples=3)
    body = client.get("/api/metrics/history", params={"series": "host.*_bytes", "window": "15m"}).json()
    assert "host.ram_used_bytes" in body["series"] and body["window_s"] == 900
    times = [t for t, _v in body["series"]["host.ram_used_bytes"]]
    assert len(times) >= 3 and times == sorted(times)
    missing = client.get("/api/metrics/history", params={"series": "gpu.*.nothing,host.cpu_pct"})
    assert missing.json()["unmatched"] == ["gpu.*.nothing"]
    bad = client.get("/api/metrics/history", params={"series": "host.cpu_pct", "window": "soon"})
    assert bad.status_code == 422 and "15m, 1h, 24h" in bad.json()["detail"]
    assert client.get("/api/metrics/history").status_code == 422  # series is required


def test_overview_renders_whole_before_the_stream_starts(client, tiny_llama):
    assert client.post("/api/models", json=_tiny_config(tiny_llama)).status_code == 201
    snap = _first_sample(client)
    html = client.get("/").text
    assert 'sse-connect="/api/metrics/stream?view=overview"' in html
    assert "<option>tiny</option>" in html  # the Start worker menu lists the config
    if not snap["gpu"]["available"]:
        assert "No NVIDIA GPU detected" in html
    assert 'data-testid="host-ram"' in html and "No workers yet" in html
    assert "cdn" not in html.lower() and "https://" not in html  # everything is served locally
    for asset in ("htmx.min.js", "sse.min.js", "uPlot.iife.min.js", "uPlot.min.css"):
        assert client.get(f"/static/vendor/{asset}").status_code == 200


def test_api_docs_pages_load_their_scripts_from_the_manager(client):
    """/docs and /redoc name no other host (they must work offline), and what they load is served."""
    import re

    for path in ("/docs", "/redoc"):
        html = client.get(path).text
        assert "https://" not in html and "http://" not in html, path
        assets = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", html)
        assert any(a.endswith(".js") for a in assets), path
        for asset in assets:
            assert client.get(asset).status_code == 200, asset


def test_model_form_errors_come_back_next_to_their_fields(client):
    resp = client.post("/ui/models/new", data={"name": "x", "model": "m",
                                               "gpu_memory_utilization": "3", "port": "99999"})  # fmt: skip
    assert resp.status_code == 200 and "HX-Redirect" not in resp.headers
    assert 'data-field="gpu_memory_utilization">Input should be less than or equal to 1' in resp.text
    assert 'data-field="port">Input should be less than or equal to 65535' in resp.text
    assert 'value="m"' in resp.text  # the user's input is kept
    assert client.get("/api/models/x").status_code == 404


def test_model_form_creates_then_edits_a_config_like_the_api(client, tiny_llama):
    form = {"name": "tiny", "model": str(tiny_llama), "gpu_memory_utilization": "0.2",
            "extra_args": "--load-format dummy", "env": "VLLM_LOGGING_LEVEL=DEBUG"}  # fmt: skip
    created = client.post("/ui/models/new", data=form)
    assert created.headers["HX-Redirect"] == "/models/tiny"
    stored = client.get("/api/models/tiny").json()
    assert stored["extra_args"] == ["--load-format", "dummy"]
    assert stored["env"] == {"VLLM_LOGGING_LEVEL": "DEBUG"}
    again = client.post("/ui/models/new", data=form)
    assert 'data-field="name">a model config named' in again.text
    edited = client.post("/ui/models/tiny", data={**form, "max_model_len": "512", "offload_profile": "nope"})
    assert 'data-field="offload_profile">no offload profile named' in edited.text
    edited = client.post("/ui/models/tiny", data={**form, "max_model_len": "512"})
    assert "Saved." in edited.text and edited.headers["HX-Trigger"] == "config-saved"
    assert client.get("/api/models/tiny").json()["max_model_len"] == 512
    preview = client.get("/ui/models/tiny/command").text
    assert "--max-model-len=512" in preview and "--load-format dummy" in preview
    assert "tiny" in client.get("/models").text


def test_profile_form_shows_rules_about_two_fields_above_it(client):
    resp = client.post("/ui/profiles/new", data={"name": "p", "lora_cpu_pooling": "on"})
    assert 'data-field="_form">lora_pool_gib is required when lora_cpu_pooling is on' in resp.text
    ok = client.post("/ui/profiles/new", data={"name": "p", "kv_offload_gib": "8"})
    assert ok.headers["HX-Redirect"] == "/models"
    assert client.get("/api/profiles/p").json()["kv_offload_gib"] == 8


def test_form_posts_need_the_token_once_one_exists(settings):
    settings.ensure_dirs()
    engine = make_engine(settings.db_path)
    migrate(engine)
    with session(engine) as db:
        token = tokens.create_token(db)
    engine.dispose()
    with TestClient(create_app(settings)) as c:
        form = {"name": "p", "kv_offload_gib": "8"}
        assert c.post("/ui/profiles/new", data=form).status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        ok = c.post("/ui/profiles/new", data=form, headers=auth)
        assert ok.headers["HX-Redirect"] == "/models"
        assert c.get("/models").status_code == 401  # reading needs it too
        assert c.get("/models", headers=auth).status_code == 200


def test_plan_form_explains_each_line_and_offload_as_prefix_cache(client, tiny_llama):
    resp = client.post("/ui/plan", data={"model": str(tiny_llama), "gpu": "cpu", "max_model_len": "1024",
                                         "max_num_seqs": "4", "kv_offload_gib": "1",
                                         "gpu_memory_utilization": "0.5"})  # fmt: skip
    assert 'data-testid="plan-result"' in resp.text
    assert 'data-line="kv_cache_tokens"' in resp.text and 'data-line="weights_total"' in resp.text
    assert "Prefix-cache capacity from CPU KV offload" in resp.text
    assert "not extra context" in resp.text
    bad = client.post("/ui/plan", data={"model": str(tiny_llama), "gpu": "cpu", "max_num_seqs": "0"})
    assert 'data-field="max_num_seqs"' in bad.text and "plan-result" not in bad.text
    missing = client.post("/ui/plan", data={"model": "/no/such/model", "gpu": "cpu"})
    assert 'class="error form-error"' in missing.text


def test_unknown_worker_page_is_a_404_page(client):
    resp = client.get("/workers/999")
    assert resp.status_code == 404 and "no worker with id 999" in resp.text


@pytest.mark.parametrize("path", ["/", "/models", "/models/new", "/profiles/new", "/plan"])
def test_pages_link_every_section(client, path):
    html = client.get(path).text
    for link in ('href="/"', 'href="/models"', 'href="/plan"'):
        assert link in html
