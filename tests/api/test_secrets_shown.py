"""Secrets of a model config (environment values, --api-key) are seen only by token holders, and a
hidden value sent back as it was shown keeps the stored one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.schemas.common import MARKER

TOKEN = "admin-token-for-tests-" + "t" * 20
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HF = "hf_secretTOKEN0123456789"
KEY = "sk-abc123def456"
CONFIG = {
    "name": "guarded",
    "model": "org/guarded",
    "extra_args": ["--api-key", KEY, "--seed", "7"],
    "env": {"HF_TOKEN": HF, "VLLM_LOGGING_LEVEL": "INFO"},
}
READS = [
    "/api/models",
    "/api/models/guarded",
    "/api/models/guarded/command?validate=false",
    "/models/guarded",
    "/ui/models/guarded/command",
]


@pytest.fixture
def guarded(settings) -> Iterator[TestClient]:
    # Readers without the token exist where reads are left open (VLLM_MANAGER_OPEN_READS).
    with TestClient(create_app(settings.model_copy(update={"api_token": TOKEN, "open_reads": True}))) as c:
        assert c.post("/api/models", json=CONFIG, headers=AUTH).status_code == 201
        yield c


@pytest.mark.parametrize("path", READS)
def test_readers_without_the_token_never_get_a_secret(guarded, path):
    resp = guarded.get(path)
    assert resp.status_code == 200
    assert HF not in resp.text and KEY not in resp.text
    assert MARKER in resp.text or "&lt;hidden&gt;" in resp.text


@pytest.mark.parametrize("path", READS)
def test_token_holders_see_the_values_to_edit_them(guarded, path):
    resp = guarded.get(path, headers=AUTH)
    assert resp.status_code == 200
    assert HF in resp.text and KEY in resp.text


def test_the_hidden_api_view_shows_which_values_are_hidden(guarded):
    shown = guarded.get("/api/models/guarded").json()
    assert shown["extra_args"] == ["--api-key", MARKER, "--seed", "7"]
    assert shown["env"] == {"HF_TOKEN": MARKER, "VLLM_LOGGING_LEVEL": MARKER}
    command = guarded.get("/api/models/guarded/command", params={"validate": "false"}).json()
    # The engine gets its key through its environment, not its argv (which every local user can read).
    assert command["argv"][-2:] == ["--seed", "7"] and "--api-key" not in command["argv"]
    assert command["env"]["VLLM_API_KEY"] == MARKER
    assert command["env"]["HF_TOKEN"] == MARKER and command["env"]["VLLM_PLUGINS"] == "offload_patches"


def test_a_put_of_what_a_reader_saw_keeps_the_stored_secrets(guarded):
    shown = guarded.get("/api/models/guarded").json()
    shown["max_num_seqs"] = 8
    assert guarded.put("/api/models/guarded", json=shown, headers=AUTH).status_code == 200
    stored = guarded.get("/api/models/guarded", headers=AUTH).json()
    assert stored["extra_args"] == CONFIG["extra_args"] and stored["env"] == CONFIG["env"]
    assert stored["max_num_seqs"] == 8


def test_the_edit_form_saved_as_shown_keeps_the_secrets_and_shows_none(guarded):
    form = {
        "model": "org/guarded",
        "dtype": "auto",
        "kv_cache_dtype": "auto",
        "tensor_parallel_size": "1",
        "gpu_memory_utilization": "0.8",
        "start_timeout_s": "900",
        "extra_args": f"--api-key '{MARKER}' --seed 7",
        "env": f"HF_TOKEN={MARKER}\nVLLM_LOGGING_LEVEL={MARKER}",
    }
    saved = guarded.post("/ui/models/guarded", data=form, headers=AUTH)
    assert saved.status_code == 200 and 'data-testid="saved"' in saved.text
    stored = guarded.get("/api/models/guarded", headers=AUTH).json()
    assert stored["env"] == CONFIG["env"] and stored["extra_args"] == CONFIG["extra_args"]
    assert stored["gpu_memory_utilization"] == 0.8


def test_a_marker_for_a_value_never_stored_is_a_422_that_says_so(guarded):
    body = {**CONFIG, "env": {**CONFIG["env"], "WANDB_API_KEY": MARKER}}
    refused = guarded.put("/api/models/guarded", json=body, headers=AUTH)
    assert refused.status_code == 422 and "WANDB_API_KEY" in refused.json()["detail"]


def test_without_any_token_everyone_sees_the_values(client):
    assert client.post("/api/models", json=CONFIG).status_code == 201
    assert client.get("/api/models/guarded").json()["env"]["HF_TOKEN"] == HF
    assert KEY in client.get("/ui/models/guarded/command").text
