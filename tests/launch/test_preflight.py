"""Before a start on a GPU box, a config that cannot fit is refused with the plan's numbers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from manager.errors import Invalid
from manager.launch import preflight
from manager.launch.preflight import HostClaims, Sleeper
from manager.planner import make_plan, model_files
from manager.planner.gpus import gpu_from_catalogue
from manager.planner.host import HostMemory
from manager.planner.weights import estimate_weights
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile

G = 1 << 30
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
    preflight.refuse_if_it_cannot_fit(fits_alone, None, force=False, claims=HostClaims())
    huge = preflight.read_host_memory().usable_ram  # others already claim all of this machine's RAM
    with pytest.raises(Invalid) as refused:
        preflight.refuse_if_it_cannot_fit(fits_alone, None, force=False, claims=HostClaims(profile_bytes=huge))
    assert "host RAM" in refused.value.message
    assert not isinstance(refused.value, preflight.HostRamHeldBySleepers)


@pytest.fixture
def host_64g(monkeypatch) -> HostMemory:
    host = HostMemory(ram_total=64 * G, ram_available=60 * G, shm_total=32 * G, shm_free=32 * G, cgroup_limit=None)
    monkeypatch.setattr(preflight, "read_host_memory", lambda: host)
    return host


def _asleep(worker_id: int, config: str, gib: float, level: int = 1) -> Sleeper:
    return Sleeper(worker_id, config, level, int(gib * G))


def test_a_start_that_needs_the_ram_sleeping_workers_hold_is_refused_naming_them(coder_awq, rtx_4090, host_64g):
    coder = _coder_config(coder_awq, max_model_len=8192)
    # One sleeper leaves room enough: the start goes ahead.
    preflight.refuse_if_it_cannot_fit(coder, None, False, HostClaims(sleepers=(_asleep(3, "chat", 16),)))
    sleepers = (_asleep(3, "chat", 40), _asleep(4, "embed", 16))
    with pytest.raises(preflight.HostRamHeldBySleepers) as refused:
        preflight.refuse_if_it_cannot_fit(coder, None, False, HostClaims(sleepers=sleepers))
    held = refused.value
    plan = make_plan(preflight.plan_request(coder, None, "detected"), gpu=gpu_from_catalogue("rtx-4090"), host=host_64g)
    needed = plan.host_ram_needed_bytes
    assert 8 * G < needed < 64 * G
    assert held.short_bytes == needed - 8 * G  # 64 GiB less the 56 the sleepers hold
    assert held.sleepers == sleepers and held.status == 422
    assert f"needs {needed / G:.1f} GiB of host RAM and 8.0 GiB is usable" in held.message
    assert "chat (worker 3, level 1, 40.0 GiB), embed (worker 4, level 1, 16.0 GiB); 56.0 GiB in all" in held.message
    assert "Stop one of them first" in held.message


def test_a_level_two_sleeper_holds_no_ram(coder_awq, rtx_4090, host_64g):
    coder = _coder_config(coder_awq, max_model_len=8192)
    preflight.refuse_if_it_cannot_fit(coder, None, False, HostClaims(sleepers=(_asleep(3, "chat", 0, level=2),)))


def test_when_stopping_sleepers_would_not_be_enough_the_plans_refusal_counts_both(coder_awq, rtx_4090, host_64g):
    coder = _coder_config(coder_awq, max_model_len=8192)
    claims = HostClaims(profile_bytes=60 * G, sleepers=(_asleep(3, "chat", 2),))
    with pytest.raises(Invalid) as refused:
        preflight.refuse_if_it_cannot_fit(coder, None, False, claims)
    assert not isinstance(refused.value, preflight.HostRamHeldBySleepers)
    message = refused.value.message
    held = "claimed by running workers: 60.0 GiB; held by sleeping workers: 2.0 GiB"
    assert f"the plan needs 9.4 GiB, 2.0 GiB is usable (64.0 GiB less {held})" in message


def test_the_plan_shows_what_other_workers_hold(coder_awq, host_64g):
    request = preflight.plan_request(_coder_config(coder_awq, max_model_len=8192), None, "rtx-4090")
    claims = HostClaims(profile_bytes=2 * G, sleepers=(_asleep(3, "chat", 16),))
    plan = preflight.plan_now(request, claims)
    assert plan.line("ram_usable").value == 46.0
    assert plan.line("ram_held_profiles").value == 2.0
    sleeping = plan.line("ram_held_sleeping")
    assert sleeping.value == 16.0 and "chat (worker 3, level 1, 16.0 GiB)" in sleeping.explanation
    # Planning another machine's RAM leaves this machine's workers out.
    elsewhere = preflight.plan_now(request.model_copy(update={"host_ram_gib": 64}), claims)
    assert elsewhere.line("ram_usable").value == 64.0
    assert not [line for line in elsewhere.lines if line.key.startswith("ram_held")]


def test_what_a_sleep_keeps_in_host_ram(tiny_llama):
    config = ModelConfig(name="tiny", model=str(tiny_llama), sleep_level=1)
    found = model_files.read_model(str(tiny_llama))
    weights = estimate_weights(found.config, found.weights, "auto").total_bytes
    assert preflight.sleep_host_bytes(config) == 2 * weights  # pinned: up to twice the weights
    assert preflight.sleep_host_bytes(config, level=2) == 0
    assert preflight.sleep_host_bytes(config.model_copy(update={"sleep_level": None})) is None
    assert preflight.sleep_host_bytes(config.model_copy(update={"model": "/no/such/model"})) is None


def test_a_profiles_host_claim():
    profile = OffloadProfile(name="p", kv_offload_gib=8, lora_cpu_pooling=True, lora_pool_gib=2, pinned_budget_gib=1)
    assert preflight.host_bytes_of(profile) == 11 << 30
    assert preflight.host_bytes_of(None) == 0
