"""A stand-in for pynvml: the same function names and constants, pynvml's own error classes for
values a GPU does not report, and a count of NVML starts so tests can see who starts it."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml

GIB = 1024**3
MIB = 1024**2

# GPU index -> (pid, usedGpuMemory) of the processes NVML lists there.
Processes = dict[int, list[tuple[int, int | None]]]

DEFAULT_PROCESSES: Processes = {
    0: [(101, 60 * GIB), (102, 30 * GIB), (999, None)],  # None: pynvml's "not available"
    1: [],
}


class FakeNvml:
    """Two GPUs: 0 is an H200; 1 is an RTX 4090 that reports no power, temperature or PCIe."""

    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_PCIE_UTIL_RX_BYTES = pynvml.NVML_PCIE_UTIL_RX_BYTES
    NVML_PCIE_UTIL_TX_BYTES = pynvml.NVML_PCIE_UTIL_TX_BYTES

    def __init__(
        self,
        init_error: Exception | None = None,
        processes: Processes | None = None,
        count: int = 2,
    ) -> None:
        self.init_error = init_error
        self.processes = DEFAULT_PROCESSES if processes is None else processes
        self.count = count
        self.init_calls = 0
        self.shutdown_calls = 0
        self.reads = 0
        self.count_error: Exception | None = None

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.86.15"

    def nvmlDeviceGetCount(self) -> int:
        self.reads += 1
        if self.count_error:
            raise self.count_error
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if not 0 <= i < self.count:
            raise pynvml.NVMLError_InvalidArgument()
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for i in range(self.count):
            if self.nvmlDeviceGetUUID(i) == uuid:
                return i
        raise pynvml.NVMLError_NotFound()

    def _unsupported_on_1(self, h: int, value: int) -> int:
        if h == 1:
            raise pynvml.NVMLError_NotSupported()
        return value

    def nvmlDeviceGetName(self, h: int) -> str | bytes:
        names: list[str | bytes] = ["NVIDIA H200", b"NVIDIA GeForce RTX 4090"]  # old pynvml returned bytes
        return names[h]

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:08d}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=[87, 3][h], memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        total = [141 * GIB, 24 * GIB][h]
        return SimpleNamespace(total=total, used=[100 * GIB, 1 * GIB][h], free=0)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._unsupported_on_1(h, 61)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._unsupported_on_1(h, 512_345)  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        if h == 1:
            raise pynvml.NVMLError_NoPermission()
        return 700_000

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[clock]

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        value = {pynvml.NVML_PCIE_UTIL_RX_BYTES: 50_000, pynvml.NVML_PCIE_UTIL_TX_BYTES: 2_000}[counter]
        return self._unsupported_on_1(h, value)  # KB/s

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes.get(h, [])]
