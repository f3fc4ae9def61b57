"""Before a start on a GPU box, a config that cannot fit is refused with the plan's numbers."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.errors import Invalid
from manager.launch import preflight
from manager.launch.command import kv_offload_bytes
from manager.launch.preflight import HostClaims, Sleeper
from manager.planner import make_plan, model_files
from manager.planner.gpus import gpu_from_catalogue
from manager.planner.host import HostMemory
from manager.planner.weights import estimate_weights
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile

G = 1 << 30
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"


def _model_folder(tmp_path: Path, name: str) -> Path:
    """A model folder holding only the fixture's config.json, as the planner reads it."""
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(FIXTURES / f"{name}.json", folder / "config.json")
    return folder


@pytest.fixture
def coder_awq(tmp_path) -> Path:
    return _model_folder(tmp_path, "Qwen3-Coder-30B-A3B-Instruct-AWQ")


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


def test_no_gpu_means_vllm_cpus_own_check(coder_awq, monkeypatch):
    from manager.planner.gpus import NoGPU

    monkeypatch.setattr(preflight, "detect_gpu", lambda: NoGPU("no NVIDIA GPU detected"))
    roomy = HostMemory(128 * G, 120 * G, 64 * G, 64 * G, None, node_total=128 * G, node_available=120 * G)
    monkeypatch.setattr(preflight, "read_host_memory", lambda: roomy)
    preflight.refuse_if_it_cannot_fit(_coder_config(coder_awq), None, force=False)
    busy = HostMemory(128 * G, 60 * G, 64 * G, 64 * G, None, node_total=128 * G, node_available=60 * G)
    monkeypatch.setattr(preflight, "read_host_memory", lambda: busy)
    with pytest.raises(Invalid, match="decrease|Lower gpu_memory_utilization"):
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


def test_through_the_sleep_pool_a_sleep_keeps_exactly_the_weights_and_the_start_counts_them(coder_awq, tiny_llama):
    config = ModelConfig(name="tiny", model=str(tiny_llama), sleep_level=1)
    found = model_files.read_model(str(tiny_llama))
    weights = estimate_weights(found.config, found.weights, "auto").total_bytes
    assert preflight.sleep_host_bytes(config, pooled=True) == weights

    # The pool is on by default for sleep level 1 and an offload profile can turn it off.
    coder = _coder_config(coder_awq, max_model_len=8192, sleep_level=1)
    pooled = preflight.plan_request(coder, None, "rtx-4090")
    off = preflight.plan_request(coder, OffloadProfile(name="no-pool", sleep_pool=False), "rtx-4090")
    level2 = preflight.plan_request(coder.model_copy(update={"sleep_level": 2}), None, "rtx-4090")
    assert pooled.sleep_pool and not off.sleep_pool and not level2.sleep_pool
    host = HostMemory(ram_total=64 * G, ram_available=60 * G, shm_total=32 * G, shm_free=32 * G, cgroup_limit=None)
    with_pool, without = (make_plan(r, host=host) for r in (pooled, off))
    line = with_pool.line("sleep_pool")
    coder_weights = with_pool.line("weights_total").value
    assert line.value == coder_weights and "exact size" in line.explanation
    assert with_pool.host_ram_needed_bytes - without.host_ram_needed_bytes == pytest.approx(coder_weights * G, rel=1e-3)


def test_running_workers_sleep_pools_count_against_a_start(coder_awq, host_64g):
    request = preflight.plan_request(_coder_config(coder_awq, max_model_len=8192), None, "rtx-4090")
    plan = preflight.plan_now(request, HostClaims(pool_bytes=30 * G))
    assert plan.line("ram_held_sleep_pools").value == 30.0
    assert plan.line("ram_usable").value == 34.0


def test_the_sleep_pool_holds_only_the_weights_that_sit_on_the_gpu(tmp_path):
    folder = tmp_path / "Qwen3-30B-A3B"
    folder.mkdir()
    shutil.copy(FIXTURES / "Qwen3-30B-A3B.json", folder / "config.json")
    config = ModelConfig(name="moe", model=str(folder), sleep_level=1)
    whole = preflight.sleep_host_bytes(config, pooled=True)
    offload = OffloadProfile(name="experts", moe_expert_offload=True, moe_gpu_cache_gib=8)
    with_offload = preflight.sleep_host_bytes(config, pooled=True, profile=offload)
    assert whole is not None and with_offload is not None
    assert with_offload < whole / 2  # the experts live in host RAM already: not backed up again
    uva = config.model_copy(update={"extra_args": ["--cpu-offload-gb", "10"]})
    assert preflight.sleep_host_bytes(uva, pooled=True) == whole - 10 * G

    # The plan's pool line follows the weights left on the GPU too; offload keeps CUDA graphs.
    host = HostMemory(ram_total=256 * G, ram_available=250 * G, shm_total=64 * G, shm_free=64 * G, cgroup_limit=None)
    request = preflight.plan_request(config, offload, "h100-80")
    plan = make_plan(request, host=host)
    assert plan.line("sleep_pool").value == pytest.approx(plan.line("weights_on_device").value, abs=0.01)
    assert "CUDA graphs" in plan.line("overhead").explanation


def test_moe_offload_plans_cuda_graph_memory_as_the_command_keeps_graphs(tmp_path):
    folder = tmp_path / "Qwen3-30B-A3B"
    folder.mkdir()
    shutil.copy(FIXTURES / "Qwen3-30B-A3B.json", folder / "config.json")
    offload = OffloadProfile(name="experts", moe_expert_offload=True, moe_gpu_cache_gib=13.5)
    graphs = preflight.plan_request(ModelConfig(name="moe", model=str(folder)), offload, "h100-80")
    assert graphs.moe_expert_offload and not graphs.enforce_eager
    eager = preflight.plan_request(ModelConfig(name="moe", model=str(folder), enforce_eager=True), offload, "h100-80")
    assert eager.enforce_eager
    with_graphs, without = make_plan(graphs), make_plan(eager)
    # The graphs' memory comes out of the KV budget, as for any config that keeps them: vLLM's KV cache for
    # this shape was 13,568 tokens (96 KiB each, 1.24 GiB) smaller with graphs than eager (H200, bench/README.md).
    assert with_graphs.line("overhead").value - without.line("overhead").value == pytest.approx(1.24, abs=0.03)
    assert with_graphs.line("kv_budget").value < without.line("kv_budget").value

    # A model folder the manager cannot read: the command runs eager, and so does the plan.
    unreadable = preflight.plan_request(ModelConfig(name="moe", model=str(tmp_path / "gone")), offload, "h100-80")
    assert unreadable.enforce_eager


@pytest.fixture
def llama_8b(tmp_path) -> Path:
    return _model_folder(tmp_path, "Llama-3.1-8B-Instruct")


@pytest.mark.parametrize("size", ["3221225472", "3G", "3072M", "3.221225472g"])
def test_a_kv_budget_given_in_extra_args_is_what_the_plan_and_the_start_check_use(llama_8b, monkeypatch, size):
    """--kv-cache-memory-bytes holds vLLM's GPU KV cache to that size (measured on an H200: 24,576
    tokens of Llama-3.1-8B for 3 GiB): the plan must say so, and refuse a context it cannot hold
    even with a CPU tier, instead of planning with the whole GPU's memory."""
    monkeypatch.setattr(preflight, "detect_gpu", lambda: gpu_from_catalogue("h200"))
    kv_profile = OffloadProfile(name="kv-16g", kv_offload_gib=16)
    config = ModelConfig(
        name="llama",
        model=str(llama_8b),
        max_model_len=16384,
        gpu_memory_utilization=0.4,
        enforce_eager=True,
        extra_args=["--kv-cache-memory-bytes", size],
    )
    plan = make_plan(preflight.plan_request(config, kv_profile, "h200"))
    assert plan.kv_cache_tokens == pytest.approx(24576, rel=0.01)
    preflight.refuse_if_it_cannot_fit(config, kv_profile, force=False)  # 16,384 tokens fit in 3 GiB

    too_long = config.model_copy(update={"max_model_len": 65536})
    with pytest.raises(Invalid) as refused:
        preflight.refuse_if_it_cannot_fit(too_long, kv_profile, force=False)
    assert "65,536" in refused.value.message or "65536" in refused.value.message


def test_sizes_are_read_as_vllm_reads_them():
    assert preflight.size_bytes("1K") == 1024 and preflight.size_bytes("1k") == 1000
    assert preflight.size_bytes("2.5G") == int(2.5 * G) and preflight.size_bytes("7") == 7
    assert preflight.size_bytes("lots") == 0


def test_at_tensor_parallel_2_each_ranks_sleep_pool_is_counted_and_a_host_for_one_only_is_refused(
    tmp_path, monkeypatch
):
    folder = _model_folder(tmp_path, "Qwen3-30B-A3B")
    fields = {"model": str(folder), "sleep_level": 1, "max_model_len": 4096, "gpu_memory_utilization": 0.85}
    one_gpu = ModelConfig(name="moe", **fields)
    two_ranks = ModelConfig(name="moe-tp2", tensor_parallel_size=2, gpu_ids=[0, 1], **fields)
    # Each rank pools the half of the weights it holds: the two pools together are the whole model once.
    whole = preflight.sleep_host_bytes(one_gpu, pooled=True)
    assert whole is not None and whole > 50 * G
    assert preflight.sleep_host_bytes(two_ranks, pooled=True) == whole

    two_h100 = replace(gpu_from_catalogue("h100-80"), count=2)
    monkeypatch.setattr(preflight, "detect_gpu", lambda: two_h100)

    def host(ram_gib: int) -> HostMemory:
        ram = ram_gib * G
        return HostMemory(ram_total=ram, ram_available=ram, shm_total=64 * G, shm_free=64 * G, cgroup_limit=None)

    # 80 GiB holds both ranks' pools beside the reserve and the engine: the start goes ahead. 60 GiB
    # would hold one rank's pool with room to spare, not both: refused, the plan's pool line the whole.
    monkeypatch.setattr(preflight, "read_host_memory", lambda: host(80))
    preflight.refuse_if_it_cannot_fit(two_ranks, None, force=False)
    short = make_plan(preflight.plan_request(two_ranks, None, "detected"), gpu=two_h100, host=host(60))
    assert short.line("sleep_pool").value == pytest.approx(whole / G, abs=0.01)
    assert short.host_ram_needed_bytes - whole // 2 < 60 * G < short.host_ram_needed_bytes
    monkeypatch.setattr(preflight, "read_host_memory", lambda: host(60))
    with pytest.raises(Invalid) as refused:
        preflight.refuse_if_it_cannot_fit(two_ranks, None, force=False)
    assert refused.value.message.startswith("host RAM: the plan needs") and refused.value.status == 422
    # The ways out are the ones that help a host that is short: not expert offload, which pins every
    # expert in RAM, nor fp8 KV, which the host does not hold; sleep level 2 takes no pool.
    fits = {way.key: way.fits for way in short.verdict.ways_out}
    assert fits["sleep_level_2"] and not fits["moe_offload"] and not fits["fp8_kv"]
    assert "with sleep_level 2" in refused.value.message and "expert offload" not in refused.value.message
