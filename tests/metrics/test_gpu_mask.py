"""A box that lends the manager some of its GPUs (CUDA_VISIBLE_DEVICES where the manager or a node's
raylet starts): the pages and plans see those GPUs only, numbered from 0 as CUDA numbers them, and an
engine lands on the driver's GPU that number stands for."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from manager.cluster.agent import NodeAgent
from manager.host.local import LocalHost
from manager.metrics.gpu import GpuCollector, Nvml
from manager.metrics.gpu_mask import engine_devices, on_driver, visible_devices
from tests.support.nvml import FakeNvml

PRINT_MASK = "import os; print('mask=' + os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'), flush=True)"


def test_the_mask_is_read_as_cuda_reads_it():
    assert visible_devices({}) is None  # every GPU
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ("2", "3")
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-00000001,1"}) == ("GPU-00000001", "1")
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "1,x,0"}) == ("1",)  # CUDA stops at the first bad entry


def test_an_engines_gpus_become_the_drivers_and_one_outside_the_mask_is_refused():
    assert on_driver("0,1", ("2", "3")) == "2,3"
    assert on_driver("1", None) == "1"
    assert on_driver("GPU-00000005", ("2",)) == "GPU-00000005"
    with pytest.raises(ValueError, match=r"GPU 1 is not one of the 1 GPU\(s\).*CUDA_VISIBLE_DEVICES=3"):
        on_driver("0,1", ("3",))
    # An engine given no GPUs sees the host's, never more.
    assert engine_devices({"HF_HOME": "/m"}, ("1",)) == {"HF_HOME": "/m", "CUDA_VISIBLE_DEVICES": "1"}
    assert engine_devices({"HF_HOME": "/m"}, None) == {"HF_HOME": "/m"}


def test_the_gpu_page_shows_only_the_lent_gpus_numbered_from_zero():
    report = GpuCollector(Nvml(FakeNvml(), mask=("1",))).sample()
    assert [(g.index, g.name, g.memory_total_bytes) for g in report.gpus] == [(0, "NVIDIA GeForce RTX 4090", 24 << 30)]
    by_uuid = GpuCollector(Nvml(FakeNvml(), mask=("GPU-00000001", "0"))).sample()
    assert [g.name for g in by_uuid.gpus] == ["NVIDIA GeForce RTX 4090", "NVIDIA H200"]
    # GPU 0 of the mask lists the processes of the driver's GPU 1, not those of its GPU 0.
    assert Nvml(FakeNvml(), mask=("1",)).compute_processes(0) == ()
    assert len(Nvml(FakeNvml(), mask=("0",)).compute_processes(0)) == 3


def _mask_seen(log: Path) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if "mask=" in text:
            return text.split("mask=")[1].strip()
        time.sleep(0.05)
    raise AssertionError(f"the engine wrote nothing to {log}")


@pytest.mark.parametrize("wanted", [{"CUDA_VISIBLE_DEVICES": "0"}, {}])
def test_an_engine_on_a_node_whose_raylet_has_gpu_1_runs_on_gpu_1(tmp_path, monkeypatch, wanted):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the raylet's, kept by the agent
    agent = NodeAgent("gpu-b")
    log = tmp_path / "engine.log"
    spawned = agent.spawn([sys.executable, "-c", PRINT_MASK], wanted, str(log), str(tmp_path / "run"))
    try:
        assert _mask_seen(log) == "1"
    finally:
        agent.stop_group(spawned.pid, 5.0)


def test_a_manager_started_with_gpu_1_starts_its_engine_on_gpu_1_and_refuses_a_gpu_it_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    host = LocalHost()
    log = tmp_path / "engine.log"
    spawned = host.spawn([sys.executable, "-c", PRINT_MASK], {"CUDA_VISIBLE_DEVICES": "0"}, log, tmp_path)
    try:
        assert _mask_seen(log) == "1"
    finally:
        host.stop_group(spawned.pid, 5.0)
    with pytest.raises(OSError, match="GPU 1 is not one of the 1 GPU"):
        NodeAgent("gpu-b").spawn(
            [sys.executable, "-c", PRINT_MASK], {"CUDA_VISIBLE_DEVICES": "1"}, str(log), str(tmp_path / "r")
        )
