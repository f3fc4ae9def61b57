"""Before a start on a GPU box, a config that cannot fit is refused with the plan's numbers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.errors import Invalid
from manager.launch import preflight
from manager.launch.command import kv_offload_bytes
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


def _full_shm(free_gib: float, stale_gib: float = 0):
    # /dev/shm as the check reads it, without filling the real one.
    return lambda: preflight.ShmRoom(free=int(free_gib * GIB), stale=int(stale_gib * GIB))


GIB = 1 << 30
HUB_MODEL = ModelConfig(name="hub", model="org/not-downloaded-yet", max_model_len=4096)


def test_a_kv_offload_start_is_refused_when_dev_shm_is_full_with_both_sizes(rtx_4090, monkeypatch):
    monkeypatch.setattr(preflight, "shm_room", _full_shm(1.5))
    profile = OffloadProfile(name="kv-8g", kv_offload_gib=8)
    # The model is not on this machine, so the planner cannot run: /dev/shm is checked all the same.
    with pytest.raises(Invalid) as refused:
        preflight.refuse_if_it_cannot_fit(HUB_MODEL, profile, force=False)
    message = refused.value.message
    assert message.startswith("/dev/shm has 1.50 GiB free; offload profile 'kv-8g' needs 8.00 GiB there")
    assert "shm_size" in message and "force" in message
    assert refused.value.detail["shm_free_bytes"] == int(1.5 * GIB)
    preflight.refuse_if_it_cannot_fit(HUB_MODEL, profile, force=True)
    preflight.refuse_if_it_cannot_fit(HUB_MODEL, None, force=False)  # no offload: no claim on /dev/shm
    monkeypatch.setattr(preflight, "shm_room", _full_shm(6, stale_gib=2.5))  # room once stale files go
    preflight.refuse_if_it_cannot_fit(HUB_MODEL, profile, force=False)


def test_a_profile_sized_in_blocks_is_checked_in_bytes(coder_awq, rtx_4090, monkeypatch):
    monkeypatch.setattr(preflight, "shm_room", _full_shm(0.25, stale_gib=0.25))
    blocks = OffloadProfile(name="kv-blocks", kv_offload_num_cpu_blocks=20000)
    config = _coder_config(coder_awq, max_model_len=8192)  # fits the GPU: only /dev/shm is short
    need, _ = kv_offload_bytes(config, blocks)
    with pytest.raises(Invalid) as refused:
        preflight.refuse_if_it_cannot_fit(config, blocks, force=False)
    message = refused.value.message
    assert message.startswith(
        "/dev/shm has 0.50 GiB free (with 0.25 GiB of stale offload files a start removes first); "
        f"offload profile 'kv-blocks' needs {need / GIB:.2f} GiB there"
    )
    assert need > GIB


def test_dev_shm_room_counts_stale_offload_files_but_not_a_live_engines(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    no_space = lambda path: shutil._ntuple_diskusage(total=8 * GIB, used=8 * GIB, free=0)  # noqa: E731
    stale = shm / "vllm_offload_gone-engine.mmap"
    stale.write_bytes(b"\1" * (1 << 20))
    room = preflight.shm_room(shm, usage=no_space)
    assert room == preflight.ShmRoom(free=0, stale=stale.stat().st_blocks * 512) and room.room >= 1 << 20
    with stale.open("rb"):  # held open, as a running engine holds its region
        assert preflight.shm_room(shm, usage=no_space) == preflight.ShmRoom(free=0, stale=0)


def test_the_api_refuses_the_start_with_the_sizes(settings, tmp_path, rtx_4090, monkeypatch):
    monkeypatch.setattr(preflight, "shm_room", _full_shm(0.5))
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nexec sleep 600\n")  # were the start to go ahead, nothing would load
    sleeper.chmod(0o755)
    with TestClient(create_app(settings.model_copy(update={"engine_python": str(sleeper)}))) as client:
        client.post("/api/profiles", json={"name": "kv-4g", "kv_offload_gib": 4})
        client.post("/api/models", json={"name": "hub", "model": "org/not-downloaded-yet", "offload_profile": "kv-4g"})
        resp = client.post("/api/workers", json={"model": "hub"})
        assert resp.status_code == 422
        assert resp.json()["detail"].startswith("/dev/shm has 0.50 GiB free; offload profile 'kv-4g' needs 4.00 GiB")
        assert client.get("/api/workers").json() == []
