"""The GPU a plan is for: the one in this machine (NVML) or a model picked from a catalogue.

Catalogue memory is the total the driver reports (nvidia-smi's "MiB" figure), which is what
vLLM multiplies by gpu_memory_utilization; the marketing "24 GB" of an RTX 4090 is 24,564 MiB.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

MiB = 1024**2


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    source: str  # "NVML" or "catalogue"
    count: int = 1  # GPUs of this kind found (NVML) or assumed (catalogue)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 1024**3


@dataclass(frozen=True)
class NoGPU:
    """Typed "not available": why no GPU figures could be read."""

    reason: str


# key -> (display name, total MiB as the driver reports it)
CATALOGUE: dict[str, tuple[str, int]] = {
    "rtx-3090": ("NVIDIA GeForce RTX 3090 24 GB", 24576),
    "rtx-4090": ("NVIDIA GeForce RTX 4090 24 GB", 24564),
    "rtx-5090": ("NVIDIA GeForce RTX 5090 32 GB", 32607),
    "rtx-a6000": ("NVIDIA RTX A6000 48 GB", 49140),
    "rtx-6000-ada": ("NVIDIA RTX 6000 Ada 48 GB", 49140),
    "l4": ("NVIDIA L4 24 GB", 23034),
    "a10": ("NVIDIA A10 24 GB", 23028),
    "l40s": ("NVIDIA L40S 48 GB", 46068),
    "a100-40": ("NVIDIA A100 40 GB", 40960),
    "a100-80": ("NVIDIA A100 80 GB", 81920),
    "h100-80": ("NVIDIA H100 80 GB", 81559),
    "h100-nvl": ("NVIDIA H100 NVL 94 GB", 95830),
    "h200": ("NVIDIA H200 141 GB", 143771),
    "b200": ("NVIDIA B200 180 GB", 183359),
}


def catalogue() -> list[GPU]:
    return [GPU(name, mib * MiB, "catalogue") for name, mib in CATALOGUE.values()]


def _normalise(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


def gpu_from_catalogue(name: str) -> GPU:
    """A catalogue GPU by key ("rtx-4090") or by a distinctive part of its name ("4090", "H200")."""
    wanted = _normalise(name)
    for key, (display, mib) in CATALOGUE.items():
        if wanted == _normalise(key):
            return GPU(display, mib * MiB, "catalogue")
    matches = [
        (display, mib)
        for key, (display, mib) in CATALOGUE.items()
        if wanted and (wanted in _normalise(display) or wanted in _normalise(key))
    ]
    if len(matches) == 1:
        display, mib = matches[0]
        return GPU(display, mib * MiB, "catalogue")
    known = ", ".join(CATALOGUE)
    if matches:
        raise ValueError(
            f"GPU {name!r} matches several models ({', '.join(m[0] for m in matches)}); use one of: {known}"
        )
    raise ValueError(f"unknown GPU {name!r}; use one of: {known}, or 'detected' for this machine's GPU")


def detect_gpu() -> GPU | NoGPU:
    """GPU 0 of this machine through NVML (nvidia-ml-py); NoGPU with the reason when there is none."""
    try:
        import pynvml
    except ImportError:
        return NoGPU("nvidia-ml-py is not installed, so NVML cannot be read")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return NoGPU(f"no NVIDIA GPU: NVML did not start ({exc})")
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return NoGPU("no NVIDIA GPU: NVML reports 0 devices")
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        return GPU(name, total, "NVML", count)
    except Exception as exc:
        return NoGPU(f"NVML could not read GPU 0: {exc}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def resolve_gpu(name: str) -> GPU | NoGPU:
    """ "detected" reads this machine; anything else is looked up in the catalogue."""
    if name in ("", "detected", "auto"):
        return detect_gpu()
    return gpu_from_catalogue(name)
