"""MoE expert offload: expert weights in host memory, a small GPU expert cache, fast copies.

Torch-only core (no vLLM): ``store`` (host copies), ``slots`` (LRU slot table), ``gather``
(copy kernels), ``experts`` (expert math), ``offload`` (the runtime), ``stats``; ``sizing`` is
pure arithmetic for the planner. ``engine_patches.vllm_adapters.moe`` is the thin part that patches vLLM.
"""

from .sizing import ExpertOffloadSizing, expert_offload_sizing

__all__ = ["ExpertOffloadSizing", "expert_offload_sizing"]
