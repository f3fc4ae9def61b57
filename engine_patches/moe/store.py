"""All expert weights of a model in exact-size host memory, one (w13, w2) pair per MoE layer.

Host tensors come from an allocator callable: by default the process-wide exact-size pinned
allocator (``engine_patches.pinned.empty_pinned``), which shares the pin budget with every other
user in the process and gives pageable memory on a CPU-only machine. Pinning is worth 6x on every
copy (pageable host-to-GPU copies measured 6x slower on the H200), so a store that ended up pageable says so in ``pinned``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_patches.pinned import empty_pinned

HostAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def is_pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # no accelerator runtime: nothing can be pinned
        return False


@dataclass
class LayerExperts:
    """One MoE layer's experts in host memory: w13 [E, 2I, H] and w2 [E, H, I] (or any [E, ...])."""

    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def expert_bytes(self) -> int:
        return self.w13[0].numel() * self.w13.element_size() + self.w2[0].numel() * self.w2.element_size()


class ExpertStore:
    """Owns the host copies; the GPU cache only ever reads from here."""

    def __init__(self, allocator: HostAllocator | None = None) -> None:
        self._alloc = allocator or empty_pinned
        self.layers: list[LayerExperts] = []

    def add_layer(self, w13: torch.Tensor, w2: torch.Tensor) -> int:
        """Copy one layer's expert weights (from any device) into host memory; returns its index."""
        if w13.shape[0] != w2.shape[0]:
            raise ValueError(f"w13 has {w13.shape[0]} experts but w2 has {w2.shape[0]}: pass one layer's weights")
        host = []
        for w in (w13, w2):
            h = self._alloc(tuple(w.shape), w.dtype)
            h.copy_(w.detach())
            host.append(h)
        self.layers.append(LayerExperts(host[0], host[1]))
        return len(self.layers) - 1

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for lay in self.layers for t in (lay.w13, lay.w2))

    @property
    def pinned(self) -> bool:
        return bool(self.layers) and all(is_pinned(lay.w13) and is_pinned(lay.w2) for lay in self.layers)
