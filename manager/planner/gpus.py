"""The GPU a plan is for: the one in this machine (NVML) or a model picked from a catalogue.

Catalogue memory is the total the driver reports (nvidia-smi's "MiB" figure); the marketing
"24 GB" of an RTX 4090 is 24,564 MiB. vLLM multiplies CUDA's own total by gpu_memory_utilization,
which is about 0.6 GiB less (measured on an H200; the plan takes that off, gpu_side.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from manager.metrics.gpu import Nvml

MiB = 1024**2
CUDA_RESERVED_BYTES = int(0.6 * 1024**3)  # CUDA's total is about this much below NVML's (H200, vLLM 0.32)
# Measured with vLLM 0.32 (its "Requested memory" over the utilization, against NVML's total): GPUs not
# here are taken as CUDA_RESERVED_BYTES, the larger figure, which plans less KV, never more.
MEASURED_CUDA_RESERVED = {"h100 80gb": int(0.468 * 1024**3), "h200": int(0.600 * 1024**3)}


def _measured_key(gpu: GPU) -> str | None:
    name = gpu.name.lower().replace(" ", "")
    return next((key for key in MEASURED_CUDA_RESERVED if key.replace(" ", "") in name), None)


def measured_gpu(gpu: GPU) -> bool:
    """Whether the planner's figures for ``gpu`` were measured against vLLM, not carried over."""
    return _measured_key(gpu) is not None


def cuda_reserved_bytes(gpu: GPU) -> int:
    """How far CUDA's total memory (what vLLM's utilization applies to) is below NVML's on ``gpu``."""
    key = _measured_key(gpu)
    return MEASURED_CUDA_RESERVED[key] if key else CUDA_RESERVED_BYTES


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


def detect_gpu(nvml: Nvml | None = None) -> GPU | NoGPU:
    """GPU 0 of this machine through NVML; NoGPU with the reason when there is none.

    ``nvml`` is the session to read through; by default the manager's shared one, so a plan page
    does not start and stop NVML on every view.
    """
    # Imported here: the planner's pure part needs nothing from the metrics package.
    from manager.metrics.gpu import NO_GPU, NvmlUnavailable, shared_nvml

    devices = (nvml if nvml is not None else shared_nvml()).devices()
    if isinstance(devices, NvmlUnavailable):
        return NoGPU(f"{NO_GPU}: {devices.reason}")
    if not devices:
        return NoGPU(f"{NO_GPU}: NVML reports 0 devices")
    first = devices[0]
    if first.name is None or first.memory_total_bytes is None:
        return NoGPU("NVML could not read GPU 0's name and total memory")
    return GPU(first.name, first.memory_total_bytes, "NVML", len(devices))


def resolve_gpu(name: str) -> GPU | NoGPU:
    """ "detected" reads this machine; anything else is looked up in the catalogue."""
    if name in ("", "detected", "auto"):
        return detect_gpu()
    return gpu_from_catalogue(name)
