"""After a stop: no process may still hold the worker's GPUs. Checked through NVML where it works."""

from __future__ import annotations

import os
import signal

from manager.metrics.gpu import Nvml, NvmlUnavailable, shared_nvml


def end_gpu_orphans(gpus: list[int], engine_pids: list[int], nvml: Nvml | None = None) -> list[str]:
    """End processes of the stopped engine that NVML still lists on its GPUs; report what happened.

    ``gpus`` are the worker's GPU indices (empty: all of them). Only pids that belonged to the
    engine's process tree are ended: another program's use of the same GPU is reported, never
    killed. Without NVML (no driver) there is nothing to check. ``nvml`` is the session to read
    through; by default the manager's shared one.
    """
    session = nvml if nvml is not None else shared_nvml()
    if gpus:
        indices: list[int] | range = gpus
    else:
        count = session.device_count()
        if isinstance(count, NvmlUnavailable):
            return []
        indices = range(count)
    ours = set(engine_pids)
    notes: list[str] = []
    for index in indices:
        procs = session.compute_processes(index)
        if isinstance(procs, NvmlUnavailable):
            continue
        for proc in procs:
            if proc.pid in ours:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                    notes.append(f"ended pid {proc.pid} still holding GPU {index}")
                except ProcessLookupError:
                    pass
            elif gpus:
                mib = (proc.used_memory_bytes or 0) >> 20
                notes.append(f"GPU {index} is still used by pid {proc.pid} ({mib} MiB), not ours")
    return notes
