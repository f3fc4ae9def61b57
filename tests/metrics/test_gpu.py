"""GPU collector and the shared NVML session: the no-NVML path for real; the NVML mapping with a
stand-in that has pynvml's function names and raises pynvml's own error classes for values a GPU
does not report."""

from __future__ import annotations

import pynvml
import pytest

from manager.host.gpu_cleanup import end_gpu_orphans
from manager.metrics import gpu
from manager.metrics.gpu import NO_GPU, GpuCollector, GpuDevice, GpuProcess, Nvml, NvmlUnavailable, worker_gpu_memory
from manager.planner.gpus import GPU, detect_gpu
from tests.support.nvml import GIB, FakeNvml


def test_machine_without_nvidia_driver_reports_no_gpu_instead_of_raising():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # pragma: no cover - only on a machine with a driver
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver; the no-GPU path cannot be shown here")
    report = GpuCollector().sample()
    assert report.available is False
    assert report.reason.startswith(NO_GPU)
    assert "driver" in report.reason  # tells the user what to check
    assert report.gpus == ()


def test_stand_in_uses_only_names_that_pynvml_has():
    names = [n for n in vars(FakeNvml) if n.startswith("nvml") or n.startswith("NVML_")]
    missing = [n for n in names if not hasattr(pynvml, n)]
    assert missing == []


def test_values_a_gpu_does_not_report_are_na_and_the_rest_are_read():
    report = GpuCollector(Nvml(FakeNvml())).sample()
    assert report.available and report.driver_version == "570.86.15"
    h200, rtx = report.gpus
    assert h200.name == "NVIDIA H200"
    assert h200.memory_used_bytes == 100 * GIB and h200.memory_total_bytes == 141 * GIB
    assert h200.utilization_pct == 87
    assert h200.temperature_c == 61
    assert h200.power_w == pytest.approx(512.345) and h200.power_limit_w == 700
    assert (h200.sm_clock_mhz, h200.memory_clock_mhz) == (1980, 2619)
    assert h200.pcie_rx_bytes_per_s == 50_000 * 1024 and h200.pcie_tx_bytes_per_s == 2_000 * 1024
    assert rtx.name == "NVIDIA GeForce RTX 4090"  # bytes decoded
    assert rtx.temperature_c is None and rtx.power_w is None and rtx.power_limit_w is None
    assert rtx.pcie_rx_bytes_per_s is None and rtx.pcie_tx_bytes_per_s is None
    assert rtx.memory_used_bytes == 1 * GIB  # what it does report is still there


def test_gpu_processes_are_mapped_to_our_workers():
    report = GpuCollector(Nvml(FakeNvml())).sample({101: "llama", 102: "llama", 555: "other"})
    procs = {p.pid: p for p in report.gpus[0].processes}
    assert procs[101].worker_id == "llama" and procs[999].worker_id is None
    assert procs[999].used_memory_bytes is None
    assert worker_gpu_memory(report) == {"llama": 90 * GIB}


def test_missing_library_is_not_retried_every_second():
    nvml = FakeNvml(init_error=pynvml.NVMLError_LibraryNotFound())
    now = [0.0]
    collector = GpuCollector(Nvml(nvml, retry_s=60, clock=lambda: now[0]), cache_s=0, clock=lambda: now[0])
    for t in range(0, 50, 1):
        now[0] = float(t)
        report = collector.sample()
    assert not report.available and "NVMLError_LibraryNotFound" in report.reason
    assert nvml.init_calls == 1
    now[0] = 61.0
    collector.sample()
    assert nvml.init_calls == 2


def test_driver_that_comes_back_is_picked_up_on_retry():
    nvml = FakeNvml(init_error=pynvml.NVMLError_DriverNotLoaded())
    now = [0.0]
    collector = GpuCollector(Nvml(nvml, retry_s=10, clock=lambda: now[0]), cache_s=0, clock=lambda: now[0])
    assert not collector.sample().available
    nvml.init_error = None
    now[0] = 11.0
    assert collector.sample().available


def test_gpu_lost_mid_run_turns_into_a_no_gpu_report():
    nvml = FakeNvml()
    collector = GpuCollector(Nvml(nvml), cache_s=0)
    assert collector.sample().available
    nvml.count_error = pynvml.NVMLError_GpuIsLost()
    report = collector.sample()
    assert not report.available and "GpuIsLost" in report.reason


def test_readers_within_the_cache_window_share_one_read():
    nvml = FakeNvml()
    now = [0.0]
    collector = GpuCollector(Nvml(nvml), cache_s=0.5, clock=lambda: now[0])
    collector.sample()
    now[0] = 0.3
    collector.sample({101: "w"})  # tagging still applies to the cached report
    assert nvml.reads == 1
    now[0] = 0.6
    collector.sample()
    assert nvml.reads == 2


def test_device_list_and_processes_for_the_planner_and_the_cleanup():
    nvml = Nvml(FakeNvml())
    assert nvml.device_count() == 2
    assert nvml.devices() == (
        GpuDevice(0, "NVIDIA H200", 141 * GIB),
        GpuDevice(1, "NVIDIA GeForce RTX 4090", 24 * GIB),
    )
    procs = nvml.compute_processes(0)
    assert isinstance(procs, tuple) and GpuProcess(999, None) in procs
    assert nvml.compute_processes(1) == ()
    missing = nvml.compute_processes(7)
    assert isinstance(missing, NvmlUnavailable) and "GPU 7" in missing.reason


def test_without_a_driver_every_read_is_a_typed_not_available():
    fake = FakeNvml(init_error=pynvml.NVMLError_DriverNotLoaded())
    nvml = Nvml(fake)
    for read in (nvml.device_count, nvml.devices, lambda: nvml.compute_processes(0)):
        gone = read()
        assert isinstance(gone, NvmlUnavailable) and "driver" in gone.reason
    assert not nvml.report().available
    assert fake.init_calls == 1  # within the retry window nobody probes again


def test_close_ends_the_session_and_the_next_read_starts_a_new_one():
    fake = FakeNvml()
    nvml = Nvml(fake)
    assert nvml.device_count() == 2 and nvml.device_count() == 2
    assert fake.init_calls == 1
    nvml.close()
    assert fake.shutdown_calls == 1
    assert nvml.device_count() == 2
    assert fake.init_calls == 2


class ClosedDuringRead(FakeNvml):
    """NVML closed by another thread between a reader's start and its read."""

    def __init__(self) -> None:
        super().__init__()
        self.closer: Nvml | None = None

    def nvmlDeviceGetCount(self) -> int:
        if self.closer is not None:
            closer, self.closer = self.closer, None
            closer.close()
            raise pynvml.NVMLError_Uninitialized()
        return super().nvmlDeviceGetCount()


def test_a_read_cut_short_by_close_is_not_a_lost_gpu():
    fake = ClosedDuringRead()
    nvml = Nvml(fake, retry_s=60)
    fake.closer = nvml
    assert isinstance(nvml.device_count(), NvmlUnavailable)
    assert nvml.device_count() == 2  # started again at once, not after retry_s
    assert fake.init_calls == 2


def test_metrics_planner_and_cleanup_share_one_nvml_start(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setattr(gpu, "_shared", Nvml(fake))
    assert GpuCollector(cache_s=0).sample().available
    found = detect_gpu()
    assert isinstance(found, GPU) and (found.name, found.count) == ("NVIDIA H200", 2)
    notes = end_gpu_orphans([0], [])
    assert any("pid 999 (0 MiB), not ours" in n for n in notes)  # usedGpuMemory None: 0 MiB
    GpuCollector(cache_s=0).sample()
    detect_gpu()
    assert fake.init_calls == 1 and fake.shutdown_calls == 0
