"""GPU readings through NVML (nvidia-ml-py), as plain records, and the one NVML session of the
manager (``shared_nvml()``) that the metrics, the planner's GPU detection and the cleanup after a
stop all read through.

Every reading may be missing: a GPU that does not report a value (NotSupported on consumer cards,
NoPermission in some containers) gives ``None`` for that field, which the pages show as "n/a".
Without the NVML library or driver the report says "no NVIDIA GPU detected" and why; nothing here
raises into the caller.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, NamedTuple

from manager.metrics.gpu_mask import ENV, visible_devices

log = logging.getLogger(__name__)

NO_GPU = "no NVIDIA GPU detected"


@dataclass(frozen=True)
class GpuProcess:
    """A process holding GPU memory; ``worker_id`` is set when it belongs to one of our workers."""

    pid: int
    used_memory_bytes: int | None
    worker_id: str | None = None


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str | None
    uuid: str | None
    utilization_pct: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temperature_c: float | None
    power_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: int | None
    memory_clock_mhz: int | None
    pcie_rx_bytes_per_s: float | None
    pcie_tx_bytes_per_s: float | None
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuReport:
    """All GPUs at one moment. ``available`` is False when NVML cannot be used; ``reason``
    says why."""

    available: bool
    reason: str | None = None
    driver_version: str | None = None
    gpus: tuple[GpuSample, ...] = field(default_factory=tuple)

    @classmethod
    def unavailable(cls, why: str) -> GpuReport:
        return cls(available=False, reason=f"{NO_GPU}: {why}")


def _load_pynvml() -> ModuleType:
    import pynvml  # from the nvidia-ml-py package

    return pynvml


@dataclass(frozen=True)
class NvmlUnavailable:
    """Typed "not available": NVML cannot be used (no package, no driver, GPU lost) or one GPU
    cannot be read. ``reason`` says why, in words a user can act on."""

    reason: str


@dataclass(frozen=True)
class GpuDevice:
    """What a plan needs to know about one GPU; ``None`` where NVML does not report it."""

    index: int
    name: str | None
    memory_total_bytes: int | None


class _Session(NamedTuple):
    module: Any  # pynvml, started
    number: int  # which start this is: see Nvml._count


class Nvml:
    """The process's one NVML session: started on first use, kept open, shared by every reader.

    The metrics sampler, the planner's GPU detection and the cleanup after a stop all read through
    it, so NVML is initialised once rather than once per page view or stop. Nothing here raises:
    each read returns its value or an ``NvmlUnavailable``.

    ``module`` is the pynvml module, or an object with the same function names (tests use a
    stand-in). After a failed start it tries again only every ``retry_s`` seconds: a machine without
    a driver does not get a driver by itself, and probing costs a dlopen each time.
    """

    def __init__(
        self,
        module: ModuleType | Any | None = None,
        *,
        retry_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        mask: tuple[str, ...] | None = None,
    ) -> None:
        self._module: Any = module  # pynvml has no type hints
        # The GPUs this box lends the manager (gpu_mask.py): GPU i is the driver's mask[i].
        self._mask = mask
        self._retry_s = retry_s
        self._clock = clock
        # Guards the session state only; reads run outside it (NVML itself is thread-safe), so a
        # plan does not wait behind the sampler's PCIe reads.
        self._lock = threading.Lock()
        self._ready = False
        self._number = 0  # counts starts and closes: a read that fails after a close is no lost GPU
        self._failed: tuple[float, str] | None = None  # (when, why) of the last failed start
        self._driver: str | None = None

    @property
    def driver_version(self) -> str | None:
        return self._driver

    def device_count(self) -> int | NvmlUnavailable:
        session = self._start()
        if isinstance(session, NvmlUnavailable):
            return session
        return self._count(session)

    def devices(self) -> tuple[GpuDevice, ...] | NvmlUnavailable:
        """Name and total memory of every GPU (a few cheap calls: no utilisation or PCIe reads)."""
        session = self._start()
        if isinstance(session, NvmlUnavailable):
            return session
        nvml = session.module
        count = self._count(session)
        if isinstance(count, NvmlUnavailable):
            return count
        found = []
        for index in range(count):
            handle = self._handle(nvml, index)
            if isinstance(handle, NvmlUnavailable):
                found.append(GpuDevice(index, None, None))
                continue
            mem = _optional(nvml.nvmlDeviceGetMemoryInfo, handle)
            found.append(
                GpuDevice(index, _optional(nvml.nvmlDeviceGetName, handle), None if mem is None else int(mem.total))
            )
        return tuple(found)

    def compute_processes(self, index: int) -> tuple[GpuProcess, ...] | NvmlUnavailable:
        """The processes NVML lists on GPU ``index`` (pids of this host's pid namespace)."""
        session = self._start()
        if isinstance(session, NvmlUnavailable):
            return session
        nvml = session.module
        handle = self._handle(nvml, index)
        if isinstance(handle, NvmlUnavailable):
            return handle
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception as exc:
            return NvmlUnavailable(f"GPU {index} does not list its processes ({type(exc).__name__}: {exc})")
        return _processes(procs)

    def report(self) -> GpuReport:
        """Every reading of every GPU, uncached (``GpuCollector`` caches it for the pages)."""
        session = self._start()
        if isinstance(session, NvmlUnavailable):
            return GpuReport.unavailable(session.reason)
        nvml = session.module
        count = self._count(session)
        if isinstance(count, NvmlUnavailable):
            return GpuReport.unavailable(count.reason)
        if count == 0:
            return GpuReport.unavailable("NVML found no devices")
        gpus = []
        for index in range(count):
            handle = self._handle(nvml, index)
            if isinstance(handle, NvmlUnavailable):
                log.warning("%s", handle.reason)
                gpus.append(_empty_sample(index))
                continue
            gpus.append(_read_device(nvml, index, handle))
        return GpuReport(available=True, driver_version=self._driver, gpus=tuple(gpus))

    def close(self) -> None:
        """Ends the session; the next read starts a new one."""
        with self._lock:
            if self._ready:
                # Shutting down a broken driver must not stop the manager's shutdown.
                with contextlib.suppress(Exception):
                    self._module.nvmlShutdown()
            self._ready = False
            self._number += 1

    def _start(self) -> _Session | NvmlUnavailable:
        """The started session, starting NVML if it is not; or why it cannot start."""
        with self._lock:
            if self._ready:
                return _Session(self._module, self._number)
            now = self._clock()
            if self._failed and now - self._failed[0] < self._retry_s:
                return NvmlUnavailable(self._failed[1])
            try:
                if self._module is None:
                    self._module = _load_pynvml()
                self._module.nvmlInit()
            except ImportError:
                why = "the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
            except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, _NoPermission, ...
                why = f"NVML could not start ({type(exc).__name__}: {exc}); is the NVIDIA driver installed?"
            else:
                self._ready = True
                self._failed = None
                self._number += 1
                self._driver = _optional(self._module.nvmlSystemGetDriverVersion)
                return _Session(self._module, self._number)
            self._failed = (now, why)
            log.info("NVML not available, no GPU readings: %s", why)
            return NvmlUnavailable(why)

    def _handle(self, nvml: Any, index: int) -> Any:
        if self._mask is None:
            return _handle(nvml, index)
        if index >= len(self._mask):
            return NvmlUnavailable(f"GPU {index} is not one of the {len(self._mask)} GPU(s) {ENV} lends the manager")
        entry = self._mask[index]
        if entry.isdigit():
            return _handle(nvml, int(entry))
        try:
            return nvml.nvmlDeviceGetHandleByUUID(entry)
        except Exception as exc:
            return NvmlUnavailable(f"GPU {index} ({entry}) cannot be read ({type(exc).__name__}: {exc})")

    def _count(self, session: _Session) -> int | NvmlUnavailable:
        try:
            count = int(session.module.nvmlDeviceGetCount())  # asked under a mask too: is NVML still there?
            return count if self._mask is None else len(self._mask)
        except Exception as exc:
            why = f"NVML stopped answering ({type(exc).__name__}: {exc})"
        with self._lock:
            # The driver went away under us (GPU lost, driver reload): start over after retry_s.
            # A failure caused by close() in another thread is not that.
            if self._ready and self._number == session.number:
                self._ready = False
                self._failed = (self._clock(), why)
        return NvmlUnavailable(why)


_shared = Nvml(mask=visible_devices())


def shared_nvml() -> Nvml:
    """The NVML session every part of the manager reads through (metrics, planner, cleanup)."""
    return _shared


class GpuCollector:
    """The metrics' GPU reader: caches the report briefly, so several readers in a second cost one
    read. ``nvml`` is the session to read through; by default the process's shared one."""

    def __init__(
        self,
        nvml: Nvml | None = None,
        *,
        cache_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml if nvml is not None else shared_nvml()
        self._cache_s = cache_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[float, GpuReport] | None = None

    def sample(self, pid_to_worker: Mapping[int, str] | None = None) -> GpuReport:
        """The current report; processes whose pid is in ``pid_to_worker`` are tagged with it."""
        with self._lock:
            now = self._clock()
            if self._cached and now - self._cached[0] < self._cache_s:
                return _tag_workers(self._cached[1], pid_to_worker or {})
            report = self._nvml.report()
            self._cached = (now, report)
            return _tag_workers(report, pid_to_worker or {})

    def close(self) -> None:
        """Ends the NVML session at the manager's shutdown (a later reader would start it again)."""
        with self._lock:
            self._cached = None
        self._nvml.close()


def _handle(nvml: Any, index: int) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        return NvmlUnavailable(f"GPU {index} cannot be read ({type(exc).__name__}: {exc})")


def _processes(procs: Any) -> tuple[GpuProcess, ...]:
    return tuple(
        # pynvml gives usedGpuMemory=None where the driver cannot attribute memory (WDDM, MIG).
        GpuProcess(pid=int(p.pid), used_memory_bytes=_as_int(getattr(p, "usedGpuMemory", None)))
        for p in procs
    )


def _optional(fn: Callable[..., Any], *args: Any) -> Any:
    """One NVML call; any NVMLError (NotSupported, NoPermission, ...) means "this value is n/a"."""
    try:
        value = fn(*args)
    except Exception:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _read_device(nvml: Any, index: int, handle: Any) -> GpuSample:
    util = _optional(nvml.nvmlDeviceGetUtilizationRates, handle)
    mem = _optional(nvml.nvmlDeviceGetMemoryInfo, handle)
    power_mw = _optional(nvml.nvmlDeviceGetPowerUsage, handle)
    limit_mw = _optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    # NVML reports PCIe throughput in KB/s over a 20 ms window.
    rx_kb = _optional(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
    tx_kb = _optional(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
    procs = _optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    return GpuSample(
        index=index,
        name=_optional(nvml.nvmlDeviceGetName, handle),
        uuid=_optional(nvml.nvmlDeviceGetUUID, handle),
        utilization_pct=None if util is None else float(util.gpu),
        memory_used_bytes=None if mem is None else int(mem.used),
        memory_total_bytes=None if mem is None else int(mem.total),
        temperature_c=_as_float(_optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)),
        power_w=None if power_mw is None else power_mw / 1000.0,
        power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
        sm_clock_mhz=_optional(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
        memory_clock_mhz=_optional(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM),
        pcie_rx_bytes_per_s=None if rx_kb is None else rx_kb * 1024.0,
        pcie_tx_bytes_per_s=None if tx_kb is None else tx_kb * 1024.0,
        processes=_processes(procs),
    )


def _empty_sample(index: int) -> GpuSample:
    return GpuSample(index, None, None, None, None, None, None, None, None, None, None, None, None)


def _as_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _as_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _tag_workers(report: GpuReport, pid_to_worker: Mapping[int, str]) -> GpuReport:
    if not report.available or not pid_to_worker:
        return report
    gpus = tuple(
        replace(
            g,
            processes=tuple(GpuProcess(p.pid, p.used_memory_bytes, pid_to_worker.get(p.pid)) for p in g.processes),
        )
        for g in report.gpus
    )
    return replace(report, gpus=gpus)


def worker_gpu_memory(report: GpuReport) -> dict[str, int]:
    """GPU memory per worker id, summed over its processes and GPUs (what NVML attributes)."""
    totals: dict[str, int] = {}
    for gpu in report.gpus:
        for proc in gpu.processes:
            if proc.worker_id is not None and proc.used_memory_bytes is not None:
                totals[proc.worker_id] = totals.get(proc.worker_id, 0) + proc.used_memory_bytes
    return totals
