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

The routing is drawn ahead, at the layer's first call: ``TRACE_STEPS`` steps of ``TRACE_ROWS`` rows
(Gumbel top-k for each draw, a bonus for the kept experts), on the host. A call then reads the next
step's row of that trace, with a step counter on the router's device: a few small kernels, about
what a real router's top-k costs, where drawing each step on the device took about fifteen. It runs
inside CUDA graphs (a replay reads the next step). On an H200 the change was small: batch 1 of the
12-layer benchmark ran 225.6 tokens/s with offload (216.5-220.9 before), and the resident engine
441.4 (440.0). Rows past ``TRACE_ROWS`` (a prefill) reuse the trace's rows in turn; the trace
repeats after ``TRACE_STEPS`` steps, far longer than any expert stays in a cache of this size.
"""

from __future__ import annotations

import torch

STRATEGY = "engine_patches_zipf_reuse"
KEEP_BONUS = 1.0e4  # added to a kept expert's score: far above any Gumbel score, so top-k takes it first
TRACE_STEPS = 512  # steps drawn ahead per layer: 2 MiB of ids at 64 rows of top-8
TRACE_ROWS = 64  # the benchmark's largest decode batch


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
        self.alpha, self.reuse = alpha, reuse
        # On the host, whatever default device is set (vLLM builds the model under the GPU's).
        cpu = torch.device("cpu")
        gen = torch.Generator(device=cpu).manual_seed(seed * 1_000_003 + layer)
        popularity = torch.empty(num_experts, dtype=torch.float32, device=cpu)
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float32, device=cpu)
        popularity[torch.randperm(num_experts, generator=gen, device=cpu)] = ranks.pow(-alpha)
        self.popularity = popularity / popularity.sum()  # on the host, for figures and tests
        self._log_pop = self.popularity.log()
        self._trace_rows = min(rows, TRACE_ROWS)
        gumbel = -torch.log(-torch.log(torch.rand(self._trace_rows, num_experts, generator=gen, device=cpu)))
        self._first = torch.topk(self._log_pop + gumbel, top_k, dim=1).indices  # [rows, top_k], per row
        self._trace: torch.Tensor | None = None  # [TRACE_STEPS, rows * top_k], made at the first call
        self._step: torch.Tensor | None = None  # the next step's index, on the router's device
        self._drawn: tuple[torch.Tensor, torch.Tensor] | None = None  # by draw_ahead, for the next route

    def _state(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The trace and the step counter on ``device``, made at the first call (vLLM's eager
        profiling run), on the host from torch's generator, then moved."""
        if self._trace is None or self._step is None:
            self._trace = self._draw_trace().to(device)
            self._step = torch.zeros(1, dtype=torch.long, device=device)
        elif self._trace.device != device:
            self._trace, self._step = self._trace.to(device), self._step.to(device)
        if self._log_pop.device != device:  # for draw_ahead's guesses
            self._log_pop = self._log_pop.to(device)
        return self._trace, self._step

    def _draw_trace(self) -> torch.Tensor:
        """``TRACE_STEPS`` steps of the Zipf + reuse routing of ``TRACE_ROWS`` rows, on the host."""
        cpu = torch.device("cpu")
        log_pop, prev, rows = self._log_pop.cpu(), self._first.clone(), self._trace_rows
        steps = []
        for _ in range(TRACE_STEPS):
            uniform = torch.rand(rows, self.num_experts, device=cpu).clamp_(min=1e-20)
            scores = log_pop - torch.log(-torch.log(uniform))  # Gumbel top-k = draws without replacement
            keep = torch.rand(rows, self.top_k, device=cpu) < self.reuse
            scores.scatter_add_(1, prev, keep.to(scores.dtype) * KEEP_BONUS)
            prev = torch.topk(scores, self.top_k, dim=1).indices
            steps.append(prev.reshape(-1))
        return torch.stack(steps)

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
        log_pop = self._log_pop  # on ``device`` since _draw
        uniform = torch.rand(*ids.shape, self.num_experts, device=device).clamp_(min=1e-20)
        other = torch.argmax(log_pop - torch.log(-torch.log(uniform)), dim=-1)
        right = torch.rand(ids.shape, device=device) < accuracy
        return torch.where(right, ids, other)

    def _draw(self, num_tokens: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        trace, step = self._state(device)
        ids = torch.index_select(trace, 0, step).view(self._trace_rows, self.top_k)
        step.add_(1).remainder_(TRACE_STEPS)
        if num_tokens <= self._trace_rows:
            ids = ids[:num_tokens]
        else:  # a prefill: the trace's rows in turn
            ids = ids[torch.arange(num_tokens, device=device) % self._trace_rows]
        weights = torch.full((num_tokens, self.top_k), 1.0 / self.top_k, dtype=torch.float32, device=device)
        return weights, ids
