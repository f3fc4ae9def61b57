"""After a stop: no process may still hold the worker's GPUs. Checked through NVML where it works."""

from __future__ import annotations

import contextlib
import os
import signal


def end_gpu_orphans(gpus: list[int], engine_pids: list[int], nvml=None) -> list[str]:
    """End processes of the stopped engine that NVML still lists on its GPUs; report what happened.

    Only pids that belonged to the engine's process tree are ended: another program's use of the
    same GPU is reported, never killed. Without NVML (no driver) there is nothing to check.
    """
    try:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        nvml.nvmlInit()
    except Exception:
        return []
    notes: list[str] = []
    try:
        indices = gpus or range(nvml.nvmlDeviceGetCount())
        ours = set(engine_pids)
        for index in indices:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                continue
            for proc in procs:
                if proc.pid in ours:
                    try:
                        os.kill(proc.pid, signal.SIGKILL)
                        notes.append(f"ended pid {proc.pid} still holding GPU {index}")
                    except ProcessLookupError:
                        pass
                elif gpus:
                    mib = (proc.usedGpuMemory or 0) >> 20
                    notes.append(f"GPU {index} is still used by pid {proc.pid} ({mib} MiB), not ours")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return notes
