"""GPU collector: the no-NVML path for real; the NVML mapping with a stand-in that has pynvml's
function names and raises pynvml's own error classes for values a GPU does not report."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from manager.metrics.gpu import NO_GPU, GpuCollector, worker_gpu_memory

GIB = 1024**3


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


class FakeNvml:
    """pynvml's names and constants; GPU 1 is a card that reports no power, temperature or PCIe."""

    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_PCIE_UTIL_RX_BYTES = pynvml.NVML_PCIE_UTIL_RX_BYTES
    NVML_PCIE_UTIL_TX_BYTES = pynvml.NVML_PCIE_UTIL_TX_BYTES

    def __init__(self, init_error: Exception | None = None) -> None:
        self.init_error = init_error
        self.init_calls = 0
        self.reads = 0
        self.count_error: Exception | None = None

    def nvmlInit(self):
        self.init_calls += 1
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return "570.86.15"

    def nvmlDeviceGetCount(self):
        self.reads += 1
        if self.count_error:
            raise self.count_error
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def _unsupported_on_1(self, h, value):
        if h == 1:
            raise pynvml.NVMLError_NotSupported()
        return value

    def nvmlDeviceGetName(self, h):
        return ["NVIDIA H200", b"NVIDIA GeForce RTX 4090"][h]  # old pynvml returned bytes

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08d}"

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=[87, 3][h], memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        total = [141 * GIB, 24 * GIB][h]
        return SimpleNamespace(total=total, used=[100 * GIB, 1 * GIB][h], free=0)

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._unsupported_on_1(h, 61)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._unsupported_on_1(h, 512_345)  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        if h == 1:
            raise pynvml.NVMLError_NoPermission()
        return 700_000

    def nvmlDeviceGetClockInfo(self, h, clock):
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[clock]

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        value = {pynvml.NVML_PCIE_UTIL_RX_BYTES: 50_000, pynvml.NVML_PCIE_UTIL_TX_BYTES: 2_000}[counter]
        return self._unsupported_on_1(h, value)  # KB/s

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if h == 1:
            return []
        return [
            SimpleNamespace(pid=101, usedGpuMemory=60 * GIB),
            SimpleNamespace(pid=102, usedGpuMemory=30 * GIB),
            SimpleNamespace(pid=999, usedGpuMemory=None),  # pynvml's "not available"
        ]


def test_stand_in_uses_only_names_that_pynvml_has():
    names = [n for n in vars(FakeNvml) if n.startswith("nvml") or n.startswith("NVML_")]
    missing = [n for n in names if not hasattr(pynvml, n)]
    assert missing == []


def test_values_a_gpu_does_not_report_are_na_and_the_rest_are_read():
    report = GpuCollector(FakeNvml()).sample()
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
    report = GpuCollector(FakeNvml()).sample({101: "llama", 102: "llama", 555: "other"})
    procs = {p.pid: p for p in report.gpus[0].processes}
    assert procs[101].worker_id == "llama" and procs[999].worker_id is None
    assert procs[999].used_memory_bytes is None
    assert worker_gpu_memory(report) == {"llama": 90 * GIB}


def test_missing_library_is_not_retried_every_second():
    nvml = FakeNvml(init_error=pynvml.NVMLError_LibraryNotFound())
    now = [0.0]
    collector = GpuCollector(nvml, cache_s=0, retry_s=60, clock=lambda: now[0])
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
    collector = GpuCollector(nvml, cache_s=0, retry_s=10, clock=lambda: now[0])
    assert not collector.sample().available
    nvml.init_error = None
    now[0] = 11.0
    assert collector.sample().available


def test_gpu_lost_mid_run_turns_into_a_no_gpu_report():
    nvml = FakeNvml()
    collector = GpuCollector(nvml, cache_s=0)
    assert collector.sample().available
    nvml.count_error = pynvml.NVMLError_GpuIsLost()
    report = collector.sample()
    assert not report.available and "GpuIsLost" in report.reason


def test_readers_within_the_cache_window_share_one_read():
    nvml = FakeNvml()
    now = [0.0]
    collector = GpuCollector(nvml, cache_s=0.5, clock=lambda: now[0])
    collector.sample()
    now[0] = 0.3
    collector.sample({101: "w"})  # tagging still applies to the cached report
    assert nvml.reads == 1
    now[0] = 0.6
    collector.sample()
    assert nvml.reads == 2
