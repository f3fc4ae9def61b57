"""Route vLLM's LoRA and UVA weight-offload pinning through the exact-size allocator.

vLLM 0.32 pins each LoRA tensor as it loads (``LoRAModel.from_lora_tensors``), packs MoE expert
LoRAs with ``torch.stack`` and pins the packed tensors again
(``LoRAModelManager._create_merged_loras_inplace``). Every ``pin_memory()`` goes through the
caching host allocator (power-of-two blocks, kept after free). Here the first pin is skipped (the
model manager pins every tensor of the adapter after packing anyway) and the second one makes an
exact-size pinned copy. ``UVAOffloader._maybe_offload_to_cpu`` (``--cpu-offload-gb`` with the uva
backend) gets exact-size pinned memory the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine_patches import pin_routing
from engine_patches.pinned import PinnedAllocator
from engine_patches.vllm_adapters.patching import wrap

logger = logging.getLogger("engine_patches.pinning")


def exact_pin_handler(allocator: PinnedAllocator) -> pin_routing.PinHandler:
    def pin_exact(tensor: torch.Tensor) -> torch.Tensor:
        if allocator.pinning_available() and tensor.is_pinned():
            return tensor  # what Tensor.pin_memory() does for a pinned tensor
        return allocator.pin(tensor)

    return pin_exact


def _routed_through(handler: pin_routing.PinHandler) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def routed(*args: Any, **kwargs: Any) -> Any:
            with pin_routing.routed(handler):
                return original(*args, **kwargs)

        return routed

    return make


def install_lora(allocator: PinnedAllocator) -> list[str]:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager

    pin_routing.install()
    done = []
    if wrap(LoRAModel, "from_lora_tensors", _routed_through(pin_routing.keep_pageable)):
        done.append("LoRAModel.from_lora_tensors")
    if wrap(LoRAModelManager, "_create_merged_loras_inplace", _routed_through(exact_pin_handler(allocator))):
        done.append("LoRAModelManager._create_merged_loras_inplace")
    return done


def install_uva(allocator: PinnedAllocator) -> list[str]:
    from vllm.model_executor.offloader.uva import UVAOffloader

    pin_routing.install()
    if wrap(UVAOffloader, "_maybe_offload_to_cpu", _routed_through(exact_pin_handler(allocator))):
        return ["UVAOffloader._maybe_offload_to_cpu"]
    return []
