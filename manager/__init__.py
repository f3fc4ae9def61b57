"""vllm-manager: a control plane for vLLM servers on one GPU box."""

from typing import Any


def __getattr__(name: str) -> Any:
    # Looked up when first asked for: reading the installed metadata takes longer than a CLI's start should.
    if name != "__version__":
        raise AttributeError(f"module 'manager' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("vllm-manager")
    except PackageNotFoundError:  # running from a source tree that was never installed
        found = "0.0.0+source"
    globals()["__version__"] = found
    return found
