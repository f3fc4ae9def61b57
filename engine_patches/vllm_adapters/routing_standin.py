"""vLLM adapter: the Zipf + reuse routing stand-in behind vLLM's own routing simulator switch.

vLLM 0.32 builds a ``RoutingSimulatorRouter`` for every MoE layer when
``VLLM_MOE_ROUTING_SIMULATION_STRATEGY`` is set, whatever the experts' method (resident, vLLM's
UVA offload, or ours). When that variable names ``engine_patches_zipf_reuse``, ``install()`` makes
those routers route with ``engine_patches.moe.routing_standin`` instead: one state per layer,
made with the router and numbered in the order vLLM builds the layers (the same in every
process). Any other value leaves vLLM's simulator as it is; unset, nothing is patched.
For benchmarks only: the model's answers are meaningless under it, and the manager never sets it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from engine_patches.moe.routing_standin import STRATEGY, ZipfReuseRouting
from engine_patches.vllm_adapters.patching import wrap

log = logging.getLogger("engine_patches.moe")

ENV_VAR = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"
# How often the stand-in's guess at a layer's experts, made while the layer before runs, is right
# (for fetching ahead; a real model's guess is its next router applied to the layer's input).
GUESS_ENV_VAR = "ENGINE_PATCHES_STANDIN_GUESS"
DEFAULT_GUESS_ACCURACY = 0.8
ROUTED_LAYERS: list[ZipfReuseRouting] = []  # one per MoE layer that routed through the stand-in


def guess_accuracy() -> float:
    raw = os.environ.get(GUESS_ENV_VAR, "")
    try:
        value = float(raw) if raw else DEFAULT_GUESS_ACCURACY
    except ValueError:
        raise ValueError(f"{GUESS_ENV_VAR} must be a number in [0, 1], got {raw!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{GUESS_ENV_VAR} must be in [0, 1], got {value}")
    return value


def guesser(layer: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The stand-in's guess at MoE layer ``layer``'s next experts, from a batch's hidden states
    (only their count and device matter); None when the stand-in does not route that layer."""
    if not 0 <= layer < len(ROUTED_LAYERS):
        return None
    routing, accuracy = ROUTED_LAYERS[layer], guess_accuracy()
    return lambda x: routing.draw_ahead(x.shape[0], x.device, accuracy)


def install() -> list[str]:
    """Patch the simulator's router when the variable names this stand-in; returns what it patched."""
    if os.environ.get(ENV_VAR, "") != STRATEGY:
        return []
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import RoutingSimulatorRouter

    def make_init(original):
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            # Made here, outside any compiled region: vLLM builds the layers in order.
            routing = ZipfReuseRouting(self.global_num_experts, self.top_k, layer=len(ROUTED_LAYERS))
            self.__dict__["_zipf_reuse"] = routing
            ROUTED_LAYERS.append(routing)
            if routing.layer == 0:
                log.warning(
                    "engine_patches: MoE routing is the benchmark stand-in (Zipf %.1f, reuse %.1f): "
                    "answers are meaningless",
                    routing.alpha,
                    routing.reuse,
                )

        return __init__

    def make_routing(original):
        def _compute_routing(self: Any, hidden_states, router_logits, indices_type, *, input_ids=None):
            weights, ids = self.__dict__["_zipf_reuse"].route(hidden_states.shape[0], hidden_states.device)
            return weights, ids.to(indices_type or torch.int32)  # vLLM's routers give int32 ids

        return _compute_routing

    wrap(RoutingSimulatorRouter, "__init__", make_init)
    wrap(RoutingSimulatorRouter, "_compute_routing", make_routing)
    return ["RoutingSimulatorRouter.__init__", "RoutingSimulatorRouter._compute_routing"]
