"""Before a start on a GPU box, a config that cannot fit is refused with the plan's numbers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from manager.errors import Invalid
from manager.launch import preflight
from manager.planner.gpus import gpu_from_catalogue
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"


@pytest.fixture
def coder_awq(tmp_path) -> Path:
    folder = tmp_path / "Qwen3-Coder-30B-A3B-Instruct-AWQ"
    folder.mkdir()
    shutil.copy(FIXTURES / "Qwen3-Coder-30B-A3B-Instruct-AWQ.json", folder / "config.json")
    return folder


@pytest.fixture
def rtx_4090(monkeypatch):
    # The stand-in for NVML: the catalogue's RTX 4090, as a 24 GB card would report itself.
    monkeypatch.setattr(preflight, "detect_gpu", lambda: gpu_from_catalogue("rtx-4090"))


def _coder_config(folder: Path, **fields) -> ModelConfig:
    values = {"max_model_len": 52000, "gpu_memory_utilization": 0.88, "max_num_seqs": 16, **fields}
    return ModelConfig(name="coder", model=str(folder), enforce_eager=True, **values)


def test_the_rtx4090_coder_config_is_refused_with_numbers_and_ways_out(coder_awq, rtx_4090):
    kv_profile = OffloadProfile(name="kv-73g", kv_offload_gib=73.2)
    with pytest.raises(Invalid) as refused:
        preflight.refuse_if_it_cannot_fit(_coder_config(coder_awq), kv_profile, force=False)
    message = refused.value.message
    assert "52,000" in message or "52000" in message
    assert "GiB" in message
    assert "force" in message
    ways = refused.value.detail["ways_out"]
    assert any("fp8" in w["change"] for w in ways)
    assert any(w["fits"] for w in ways)


def test_force_and_a_fitting_config_go_ahead(coder_awq, rtx_4090):
    preflight.refuse_if_it_cannot_fit(_coder_config(coder_awq), None, force=True)
    preflight.refuse_if_it_cannot_fit(_coder_config(coder_awq, max_model_len=8192), None, force=False)


def test_no_gpu_means_no_refusal(coder_awq, monkeypatch):
    from manager.planner.gpus import NoGPU

    monkeypatch.setattr(preflight, "detect_gpu", lambda: NoGPU("no NVIDIA GPU detected"))
    preflight.refuse_if_it_cannot_fit(_coder_config(coder_awq), None, force=False)


def test_api_refuses_the_start_with_422(client, coder_awq, rtx_4090):
    client.post(
        "/api/models",
        json={
            "name": "coder",
            "model": str(coder_awq),
            "max_model_len": 52000,
            "gpu_memory_utilization": 0.88,
            "max_num_seqs": 16,
        },
    )
    resp = client.post("/api/workers", json={"model": "coder"})
    assert resp.status_code == 422
    assert "force" in resp.json()["detail"]
    assert client.get("/api/workers").json() == []  # nothing half-made is left behind


def test_host_ram_claimed_by_running_workers_counts(coder_awq, rtx_4090):
    fits_alone = _coder_config(coder_awq, max_model_len=8192)
    preflight.refuse_if_it_cannot_fit(fits_alone, None, force=False, reserved_bytes=0)
    huge = preflight.read_host_memory().usable_ram  # others already claim all of this machine's RAM
    with pytest.raises(Invalid) as refused:
        preflight.refuse_if_it_cannot_fit(fits_alone, None, force=False, reserved_bytes=huge)
    assert "host RAM" in refused.value.message


def test_a_profiles_host_claim():
    profile = OffloadProfile(name="p", kv_offload_gib=8, lora_cpu_pooling=True, lora_pool_gib=2, pinned_budget_gib=1)
    assert preflight.host_bytes_of(profile) == 11 << 30
    assert preflight.host_bytes_of(None) == 0
