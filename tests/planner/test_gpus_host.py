"""GPU catalogue and detection, host memory limits."""

from __future__ import annotations

import pynvml
import pytest

from manager.metrics.gpu import Nvml
from manager.planner.gpus import GPU, NoGPU, catalogue, detect_gpu, gpu_from_catalogue, resolve_gpu
from manager.planner.host import cgroup_memory_limit, planned_host, read_host_memory
from tests.support.nvml import FakeNvml

GiB = 1024**3


@pytest.mark.parametrize(
    ("name", "gib"),
    [
        ("rtx-4090", 23.99),
        ("4090", 23.99),
        ("RTX 3090", 24.0),
        ("l40s", 44.99),
        ("a100-40", 40.0),
        ("A100 80", 80.0),
        ("h100-80", 79.65),
        ("H200", 140.4),
    ],
)
def test_catalogue_lookup_by_key_or_name(name, gib):
    assert gpu_from_catalogue(name).memory_gib == pytest.approx(gib, abs=0.01)


def test_ambiguous_or_unknown_gpu_names_list_the_choices():
    with pytest.raises(ValueError, match="several"):
        gpu_from_catalogue("a100")
    with pytest.raises(ValueError, match="rtx-4090"):
        gpu_from_catalogue("voodoo2")


def test_catalogue_has_the_issue_models():
    names = " ".join(g.name for g in catalogue())
    for model in ("RTX 4090", "RTX 3090", "L40S", "A100 40", "A100 80", "H100 80", "H200"):
        assert model in names


def test_detection_returns_a_gpu_or_the_reason():
    found = detect_gpu()
    assert isinstance(found, (GPU, NoGPU))
    if isinstance(found, NoGPU):
        assert found.reason
    assert isinstance(resolve_gpu("detected"), (GPU, NoGPU))


def test_detected_gpu_is_gpu_0_with_the_count_of_all():
    assert detect_gpu(Nvml(FakeNvml())) == GPU("NVIDIA H200", 141 * GiB, "NVML", 2)


def test_no_driver_or_no_device_is_a_reason_not_an_exception():
    no_driver = detect_gpu(Nvml(FakeNvml(init_error=pynvml.NVMLError_DriverNotLoaded())))
    assert isinstance(no_driver, NoGPU) and "driver" in no_driver.reason
    no_device = detect_gpu(Nvml(FakeNvml(count=0)))
    assert isinstance(no_device, NoGPU) and "0 devices" in no_device.reason


def test_cgroup_v2_and_v1_limits(tmp_path):
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text(str(16 * GiB))
    assert cgroup_memory_limit(tmp_path) == 16 * GiB
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")  # "unlimited"
    assert cgroup_memory_limit(v1) is None


def test_this_machine_and_a_planned_machine():
    here = read_host_memory()
    assert here.ram_total > 0 and here.usable_ram <= here.ram_total
    other = planned_host(128)
    assert other.usable_ram == 128 * GiB and other.shm_free == 64 * GiB
