"""A routing stand-in for benchmarks: Zipf expert popularity with reuse between steps.

Dummy weights route nearly every token to the same few experts, so an expert cache measured on
them hits almost always and says nothing about real speed. This stand-in replaces a layer's
router output with the routing the offload harness (bench/moe_offload.py) measures against:
per layer, expert popularity is Zipf(``alpha``) over a fixed random order of the experts, and each
row (a decode sequence, in a batch whose order holds from step to step) keeps each expert of its
previous step with probability ``reuse``; the rest are drawn by popularity without replacement.

It is for benchmarks only. Model outputs are meaningless under it. Nothing in the manager turns it
on: vLLM's own switch does, ``VLLM_MOE_ROUTING_SIMULATION_STRATEGY=engine_patches_zipf_reuse``
(see ``engine_patches.vllm_adapters.routing_standin``).

Every step is tensor work on the router's device (Gumbel top-k for the draw, a scatter for the
kept experts, an in-place copy of the state), so it runs inside CUDA graphs: a replay draws new
random numbers from the graph-safe generator and updates the state with no Python running.
"""

from __future__ import annotations

import torch

STRATEGY = "engine_patches_zipf_reuse"
KEEP_BONUS = 1.0e4  # added to a kept expert's score: far above any Gumbel score, so top-k takes it first


class ZipfReuseRouting:
    """One MoE layer's stand-in routing: ``route(n, device)`` gives (weights, ids) for n rows."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        *,
        layer: int,
        alpha: float = 1.0,
        reuse: float = 0.5,
        seed: int = 0,
        rows: int = 1024,
    ) -> None:
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        if not 0.0 <= reuse <= 1.0:
            raise ValueError(f"reuse must be in [0, 1], got {reuse}")
        self.num_experts, self.top_k, self.layer = num_experts, top_k, layer
        self.alpha, self.reuse, self.rows = alpha, reuse, rows
        # On the host, whatever default device is set (vLLM builds the model under the GPU's).
        cpu = torch.device("cpu")
        gen = torch.Generator(device=cpu).manual_seed(seed * 1_000_003 + layer)
        popularity = torch.empty(num_experts, dtype=torch.float32, device=cpu)
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float32, device=cpu)
        popularity[torch.randperm(num_experts, generator=gen, device=cpu)] = ranks.pow(-alpha)
        self.popularity = popularity / popularity.sum()  # on the host, for figures and tests
        self._log_pop = self.popularity.log()
        gumbel = -torch.log(-torch.log(torch.rand(rows, num_experts, generator=gen, device=cpu)))
        self._prev = torch.topk(self._log_pop + gumbel, top_k, dim=1).indices  # [rows, top_k], per row
        self._drawn: tuple[torch.Tensor, torch.Tensor] | None = None  # by draw_ahead, for the next route

    def _state(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's tensors on ``device``, moved at the first call (vLLM's eager profiling run)."""
        if self._prev.device != device:
            self._prev = self._prev.to(device)
            self._log_pop = self._log_pop.to(device)
        return self._log_pop, self._prev

    def route(self, num_tokens: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights (float32, 1/top_k each) and int64 expert ids [num_tokens, top_k], distinct per row:
        those ``draw_ahead`` drew for this call, if it did."""
        drawn, self._drawn = self._drawn, None
        if drawn is not None and drawn[1].shape[0] == num_tokens:
            return drawn
        return self._draw(num_tokens, device)

    def draw_ahead(self, num_tokens: int, device: torch.device | str, accuracy: float) -> torch.Tensor:
        """Draw the routing of this layer's next call now, and return a guess at its ids: each
        entry the drawn expert with probability ``accuracy``, else one drawn by popularity (which
        may be right by chance). This stands in for a real next-layer guess (the layer's router
        applied to the previous layer's input), whose accuracy dummy weights cannot show."""
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy must be in [0, 1], got {accuracy}")
        device = torch.device(device)
        self._drawn = weights, ids = self._draw(num_tokens, device)
        log_pop, _ = self._state(device)
        uniform = torch.rand(*ids.shape, self.num_experts, device=device).clamp_(min=1e-20)
        other = torch.argmax(log_pop - torch.log(-torch.log(uniform)), dim=-1)
        right = torch.rand(ids.shape, device=device) < accuracy
        return torch.where(right, ids, other)

    def _draw(self, num_tokens: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        log_pop, prev = self._state(device)
        n, rows = num_tokens, min(num_tokens, self.rows)
        uniform = torch.rand(n, self.num_experts, device=device).clamp_(min=1e-20)
        scores = log_pop - torch.log(-torch.log(uniform))  # Gumbel top-k = draws without replacement
        keep = torch.rand(rows, self.top_k, device=device) < self.reuse
        bonus = torch.zeros(rows, self.num_experts, device=device)
        bonus.scatter_(1, prev[:rows], keep.to(bonus.dtype) * KEEP_BONUS)
        scores[:rows] += bonus
        ids = torch.topk(scores, self.top_k, dim=1).indices
        prev[:rows].copy_(ids[:rows])
        weights = torch.full((n, self.top_k), 1.0 / self.top_k, dtype=torch.float32, device=device)
        return weights, ids
