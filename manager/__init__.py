"""vllm-manager: a control plane for vLLM servers on one GPU box."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vllm-manager")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
