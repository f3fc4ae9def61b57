"""Send ``Tensor.pin_memory()`` calls made inside chosen functions to another handler.

vLLM pins inline (``t = t.pin_memory()`` in the middle of long functions), so the adapters wrap
those functions in ``routed(handler)``: inside, on this thread only, ``pin_memory()`` calls the
handler (our exact-size allocator, or "keep it pageable, it is pinned later"); everywhere else it
is PyTorch's own. Torch only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

PinHandler = Callable[[torch.Tensor], torch.Tensor]

_local = threading.local()
_original_pin_memory: Callable[..., torch.Tensor] | None = None
_install_lock = threading.Lock()


def _routed_pin_memory(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    handler: PinHandler | None = getattr(_local, "handler", None)
    if handler is None or args or kwargs or self.device.type != "cpu":
        return _original_pin_memory(self, *args, **kwargs)  # type: ignore[misc]
    return handler(self)


def install() -> None:
    """Put the router in front of ``torch.Tensor.pin_memory`` (idempotent).

    Outside a ``routed`` block it calls straight through, so installing changes nothing else.
    """
    global _original_pin_memory
    with _install_lock:
        if torch.Tensor.pin_memory is _routed_pin_memory:
            return
        _original_pin_memory = torch.Tensor.pin_memory
        torch.Tensor.pin_memory = _routed_pin_memory  # type: ignore[method-assign, assignment]


def installed() -> bool:
    return torch.Tensor.pin_memory is _routed_pin_memory


@contextlib.contextmanager
def routed(handler: PinHandler) -> Iterator[None]:
    """Inside the block, this thread's ``t.pin_memory()`` returns ``handler(t)``."""
    install()
    previous = getattr(_local, "handler", None)
    _local.handler = handler
    try:
        yield
    finally:
        _local.handler = previous


def keep_pageable(tensor: torch.Tensor) -> torch.Tensor:
    """Handler for pins that are redone later on a packed copy: pinning now only costs RAM."""
    return tensor
