"""Wire the CPU LoRA pool into vLLM 0.32's adapter loading (settings.lora_pool).

vLLM loads an adapter in ``WorkerLoRAManager._load_adapter``: ``LoRAModel.from_local_checkpoint``
reads every tensor of the safetensors file, ``from_lora_tensors`` copies (and pins) each one, then
``LoRAModelManager._create_merged_loras_inplace`` stacks MoE expert LoRAs per projection and pins
the stacked copies again. With the pool:

- ``from_local_checkpoint`` reads each tensor straight from the file into a pool slot; MoE expert
  LoRAs go straight into their final stacked ``[experts, ...]`` slots (what ``pack_moe`` would
  build), so there is nothing left to stack and nothing to pin again (the slots are pinned).
- Eviction stays in step with vLLM's own CPU LoRA cache (``max_cpu_loras``): when vLLM drops an
  adapter (``AdapterLRUCache._on_remove``) the pool frees its slots, and when the pool needs room
  it evicts its least recently used adapter through vLLM's ``remove_adapter``. Adapters of the
  batch being set up, and adapters pinned in vLLM, are never evicted.
- Anything the pool does not handle (``.bin`` checkpoints, 3D or shared MoE LoRA layouts) loads the
  stock way and is logged once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_patches import stats
from engine_patches.lora_pool import CPULoRAPool, PoolStats, SafetensorsFile, TensorSpec
from engine_patches.pinned import PinnedAllocator
from engine_patches.settings import PatchSettings
from engine_patches.vllm_adapters.patching import wrap

logger = logging.getLogger("engine_patches.lora_pool")

PoolKey = tuple[int, int]  # (vLLM's lora_int_id, load number): a reload never reuses a key
POOL_KEY_ATTR = "_engine_patches_pool_key"

# .loading: (adapter manager, request) of the load in progress; .pending: its new pool key
_local = threading.local()


@dataclass
class _State:
    settings: PatchSettings
    allocator: PinnedAllocator
    pool: CPULoRAPool | None = None
    adapter_manager: Any = None  # vLLM's LoRAModelManager, for eviction
    current: dict[int, PoolKey] = field(default_factory=dict)  # lora_int_id -> its live key
    step_ids: set[int] = field(default_factory=set)  # adapters of the batch being set up
    loads: itertools.count = field(default_factory=lambda: itertools.count(1))
    load_seconds: dict[int, float] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)


_state: _State | None = None


def install(settings: PatchSettings, allocator: PinnedAllocator) -> list[str]:
    global _state
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    _state = _State(settings, allocator)
    done = []
    for owner, name, make in (
        (WorkerLoRAManager, "_load_adapter", _loading_context),
        (LoRAModel, "from_local_checkpoint", _pooled_checkpoint),
        (WorkerLoRAManager, "set_active_adapters", _batch_context),
        (LRUCacheWorkerLoRAManager, "add_adapter", _count_hits),
        (LRUCacheLoRAModelManager, "pin_adapter", _pin_in_pool),
        (AdapterLRUCache, "_on_remove", _release_on_remove),
    ):
        if wrap(owner, name, make):
            done.append(f"{owner.__name__}.{name}")
    return done


def forget() -> None:
    """Drop this process's pool and bookkeeping (tests, after patching.unwrap_all())."""
    global _state
    _state = None


def pool() -> CPULoRAPool | None:
    """This process's pool (None until the first adapter is loaded)."""
    return _state.pool if _state is not None else None


# -- patches ------------------------------------------------------------------------------------


@contextlib.contextmanager
def loading_for(adapter_manager: Any, lora_request: Any) -> Iterator[None]:
    """Inside, ``LoRAModel.from_local_checkpoint`` reads into the pool for this request.

    When the block ends normally vLLM has accepted the adapter and its pool key becomes the live
    one for ``lora_int_id``; when it raises, the slots it took are given back.
    """
    previous = getattr(_local, "loading", None), getattr(_local, "pending", None)
    _local.loading, _local.pending = (adapter_manager, lora_request), None
    started = time.perf_counter()
    try:
        yield
        if _local.pending is not None and _state is not None:
            _state.current[lora_request.lora_int_id] = _local.pending
    except BaseException:
        if _local.pending is not None and _state is not None and _state.pool is not None:
            _state.pool.remove(_local.pending)
        raise
    finally:
        _local.loading, _local.pending = previous
    if _state is not None:
        _state.load_seconds[lora_request.lora_int_id] = time.perf_counter() - started
        _publish()


def _loading_context(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_adapter_into_pool(self: Any, lora_request: Any) -> Any:
        with loading_for(self._adapter_manager, lora_request):
            return original(self, lora_request)

    return load_adapter_into_pool


def _pooled_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def from_local_checkpoint_into_pool(
        cls: Any, lora_dir: str, expected_lora_modules: set[str], peft_helper: Any, **kwargs: Any
    ) -> Any:
        loading = getattr(_local, "loading", None)
        path = os.path.join(lora_dir, "adapter_model.safetensors")
        lora = None
        if (
            loading is not None
            and _state is not None
            and os.path.isfile(path)
            and str(kwargs.get("device", "cuda")) == "cpu"
        ):
            lora = _load_into_pool(cls, loading[0], loading[1], path, expected_lora_modules, peft_helper, **kwargs)
        if lora is None:
            _warn_once(
                "stock",
                "CPU LoRA pool: %s is loaded the stock way (not a safetensors "
                "adapter read by a worker, or a MoE layout the pool does not stack)",
                lora_dir,
            )
            return original(cls, lora_dir, expected_lora_modules, peft_helper, **kwargs)
        return lora

    return from_local_checkpoint_into_pool


def _batch_context(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_active_adapters_protecting_batch(self: Any, requests: set[Any], mapping: Any) -> Any:
        if _state is None:
            return original(self, requests, mapping)
        _state.step_ids = {r.lora_int_id for r in requests if r}
        try:
            return original(self, requests, mapping)
        finally:
            _state.step_ids = set()

    return set_active_adapters_protecting_batch


def _count_hits(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_adapter_counting_hits(self: Any, lora_request: Any) -> Any:
        state = _state
        if state is not None and state.pool is not None and not getattr(lora_request, "load_inplace", False):
            # get() counts a hit (and refreshes LRU order) for a resident adapter, else a miss;
            # an int id is never a pool key, so an adapter not loaded yet counts as a miss.
            state.pool.get(state.current.get(lora_request.lora_int_id, lora_request.lora_int_id))
        return original(self, lora_request)

    return add_adapter_counting_hits


def _pin_in_pool(original: Callable[..., Any]) -> Callable[..., Any]:
    def pin_adapter_in_pool(self: Any, lora_id: int) -> Any:
        result = original(self, lora_id)
        p = pool()
        key = _state.current.get(lora_id) if _state is not None else None
        if p is not None and key is not None and key in p.resident():
            p.pin(key)
        return result

    return pin_adapter_in_pool


def _release_on_remove(original: Callable[..., Any]) -> Callable[..., Any]:
    def on_remove_releasing_slots(self: Any, key: Any, value: Any) -> Any:
        result = original(self, key, value)
        pool_key = getattr(value, POOL_KEY_ATTR, None)
        state = _state
        if pool_key is not None and state is not None and state.pool is not None:
            state.pool.remove(pool_key)
            if state.current.get(pool_key[0]) == pool_key:
                del state.current[pool_key[0]]
        return result

    return on_remove_releasing_slots


# -- loading ------------------------------------------------------------------------------------


def _load_into_pool(
    cls: Any,
    adapter_manager: Any,
    lora_request: Any,
    path: str,
    expected_lora_modules: set[str],
    peft_helper: Any,
    *,
    lora_model_id: int | None = None,
    dtype: torch.dtype | None = None,
    model_vocab_size: int | None = None,
    weights_mapper: Any = None,
    skip_prefixes: list[str] | None = None,
    moe_ep_spec: Any = None,
    **_: Any,
) -> Any:
    """The adapter with its tensors in pool slots, or None when vLLM must load it itself."""
    from vllm.lora.utils import get_lora_id

    checkpoint = SafetensorsFile(path)
    pairs, full = _index(
        cls,
        checkpoint,
        expected_lora_modules,
        peft_helper,
        model_vocab_size,
        weights_mapper,
        skip_prefixes,
        moe_ep_spec,
    )
    stacks = _moe_stacks(adapter_manager, lora_request, pairs, checkpoint)
    stacked = {m for stack in stacks.values() for m in stack.members}
    if any(".experts" in m and m not in stacked for m in pairs):
        # vLLM would stack these itself into new tensors, leaving the pool slots as dead copies.
        return None

    def spec(name: str) -> TensorSpec:
        stored = checkpoint.tensors[name]
        return stored.shape, dtype or stored.dtype

    # One slot pair per dense module; per MoE layer one [experts, ...] slot pair per projection,
    # named "<layer>#w1..3" in pack_moe's order.
    slots: dict[str, tuple[TensorSpec, TensorSpec]] = {
        m: (spec(pair.a), spec(pair.b)) for m, pair in pairs.items() if m not in stacked
    }
    for stack_name, stack in stacks.items():
        for proj, members in enumerate(stack.by_projection(), start=1):
            (a_shape, a_dtype), (b_shape, b_dtype) = (spec(pairs[members[0]].a), spec(pairs[members[0]].b))
            slots[f"{stack_name}#w{proj}"] = (((len(members), *a_shape), a_dtype), ((len(members), *b_shape), b_dtype))

    def fill(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if "#w" not in name:
            checkpoint.read_into(pairs[name].a, a)
            checkpoint.read_into(pairs[name].b, b)
            return
        stack_name, proj = name.rsplit("#w", 1)
        for expert, member in enumerate(stacks[stack_name].by_projection()[int(proj) - 1]):
            checkpoint.read_into(pairs[member].a, a[expert])
            checkpoint.read_into(pairs[member].b, b[expert])
            _, scaling = peft_helper.get_rank_and_scaling(pairs[member].peft_module)
            if scaling != 1:  # what pack_moe + optimize() do: fold the scaling into B
                b[expert].mul_(scaling)

    assert _state is not None  # _pooled_checkpoint loads into the pool only while installed
    p = _pool_for(adapter_manager)
    lora_model_id = get_lora_id() if lora_model_id is None else lora_model_id
    key: PoolKey = (lora_model_id, next(_state.loads))
    with checkpoint:
        adapter = p.load(key, slots, fill)
        _local.pending = key  # vLLM may still reject the adapter: see loading_for
        modules_to_save = _full_modules(checkpoint, full)
    first = next(iter(adapter.layers.values()), None)
    if first is not None and _state.allocator.pinning_available() and not first.lora_a.is_pinned():
        _warn_once(
            "pageable",
            "CPU LoRA pool: its slabs are pageable (pin budget reached?); "
            "vLLM will make pinned copies of the adapters, doubling their host memory. "
            "Raise pin_budget_bytes or lower lora_pool_gib.",
        )
    lora = cls(
        lora_model_id,
        peft_helper.r,
        _layer_weights(adapter, pairs, stacks, stacked, peft_helper),
        modules_to_save=modules_to_save,
    )
    setattr(lora, POOL_KEY_ATTR, key)
    return lora


@dataclass
class _Pair:
    """One module's A and B tensor names in the checkpoint, as vLLM parses them."""

    module: str
    peft_module: str  # the name before weights mapping: rank/alpha patterns refer to it
    a: str = ""
    b: str = ""


def _index(
    cls: Any,
    checkpoint: SafetensorsFile,
    expected_lora_modules: set[str],
    peft_helper: Any,
    model_vocab_size: int | None,
    weights_mapper: Any,
    skip_prefixes: list[str] | None,
    moe_ep_spec: Any,
) -> tuple[dict[str, _Pair], dict[str, dict[str, str]]]:
    """The checkpoint's LoRA pairs and full modules, checked as from_local_checkpoint checks."""
    from vllm.lora.lora_model import _is_remote_expert_key
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    saved = set(peft_helper.modules_to_save or ())
    pairs: dict[str, _Pair] = {}
    full: dict[str, dict[str, str]] = {}
    unexpected: list[str] = []
    for name in checkpoint.tensors:
        if is_base_embedding_weights(name) or (skip_prefixes and cls._should_skip_module(name, skip_prefixes)):
            continue
        if moe_ep_spec is not None and _is_remote_expert_key(name, moe_ep_spec):
            continue  # another expert-parallel rank's expert
        module, is_a = parse_fine_tuned_lora_name(name, weights_mapper)
        if "base_layer" not in name and not _expected(module, expected_lora_modules, saved):
            unexpected.append(module)
        if module in saved:
            full.setdefault(module, {})[name.split(".")[-1]] = name
            continue
        pair = pairs.setdefault(module, _Pair(module, parse_fine_tuned_lora_name(name)[0]))
        setattr(pair, "a" if is_a else "b", name)
    folder = os.path.dirname(checkpoint.path)
    if unexpected:
        raise ValueError(
            f"While loading {folder}, expected target modules in "
            f"{expected_lora_modules} but received {unexpected}. Please verify that "
            f"the loaded LoRA module is correct"
        )
    for pair in pairs.values():
        if not pair.a or not pair.b:
            raise ValueError(f"{checkpoint.path}: module {pair.module} has only one of lora_A / lora_B")
        width = checkpoint.tensors[pair.a].shape[-1]
        if model_vocab_size is not None and "lora_embedding_A" in pair.a and width != model_vocab_size:
            raise RuntimeError(
                f"The embedding LoRA size({width}) must be consistent with "
                f"the base model's vocabulary size({model_vocab_size})."
            )
    return pairs, full


def _full_modules(checkpoint: SafetensorsFile, full: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Classification heads saved whole (modules_to_save): small, kept out of the pool."""
    from vllm.lora.lora_weights import LoRAFullModuleWeights

    out = {}
    for module, parts in full.items():
        if "weight" not in parts:
            raise ValueError(f"Full module {module!r} is missing weight.")
        out[module] = LoRAFullModuleWeights(
            module_name=module,
            weight=checkpoint.read(parts["weight"]),
            bias=checkpoint.read(parts["bias"]) if "bias" in parts else None,
        )
    return out


def _layer_weights(
    adapter: Any, pairs: dict[str, _Pair], stacks: dict[str, _Stack], stacked: set[str], peft_helper: Any
) -> dict[str, Any]:
    """vLLM's weight records over the pool slots; MoE layers already packed (scaling folded)."""
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    loras: dict[str, Any] = {}
    for module, pair in pairs.items():
        if module in stacked:
            continue
        weights = LoRALayerWeights.from_config(module, peft_helper, pair.peft_module)
        weights.lora_a = adapter.layers[module].lora_a
        weights.lora_b = adapter.layers[module].lora_b
        loras[module] = weights
    for stack_name in stacks:
        layers = [adapter.layers[f"{stack_name}#w{proj}"] for proj in (1, 2, 3)]
        loras[stack_name] = PackedLoRALayerWeights(
            stack_name,
            layers[0].lora_a.shape[1],
            [peft_helper.lora_alpha] * 3,
            [layer.lora_a for layer in layers],
            [layer.lora_b for layer in layers],
            scaling=[1, 1, 1],
        )
    return loras


@dataclass
class _Stack:
    """One MoE layer's experts, in vLLM's packed order [e0 w1, e0 w2, e0 w3, e1 w1, ...]."""

    members: list[str]

    def by_projection(self) -> list[list[str]]:
        return [self.members[0::3], self.members[1::3], self.members[2::3]]


def _moe_stacks(
    adapter_manager: Any, lora_request: Any, pairs: dict[str, _Pair], checkpoint: SafetensorsFile
) -> dict[str, _Stack]:
    """The MoE layers whose expert LoRAs can be written in pack_moe's layout inside the pool."""
    from vllm.lora.layers import FusedMoE3DWithLoRA, FusedMoEWithLoRA

    if (
        adapter_manager._enable_moe_shared_loras
        or adapter_manager._is_non_gated_moe
        or (adapter_manager._enable_mixed_moe_lora_format and getattr(lora_request, "is_3d_lora_weight", False))
    ):
        if any(".experts." in m for m in pairs):
            _warn_once(
                "moe-layout",
                "CPU LoRA pool: this MoE LoRA layout (shared, non-gated or 3D) is stacked by vLLM, outside the pool",
            )
        return {}
    stacks: dict[str, _Stack] = {}
    for module_name, members in adapter_manager.packed_modules.items():
        module = adapter_manager.modules.get(module_name)
        if (
            not module_name.endswith(".experts")
            or not isinstance(module, FusedMoEWithLoRA)
            or isinstance(module, FusedMoE3DWithLoRA)
        ):
            continue
        members = adapter_manager._restrict_to_local_experts(module_name, members)
        if not members or len(members) % 3 or not all(m in pairs for m in members):
            continue  # vLLM handles partial expert sets (it pads or refuses) the stock way
        stack = _Stack(list(members))
        uniform = all(
            len({(checkpoint.tensors[pairs[m].a].shape, checkpoint.tensors[pairs[m].b].shape) for m in proj}) == 1
            for proj in stack.by_projection()
        )
        if uniform:
            stacks[module_name] = stack
    return stacks


def _expected(module: str, expected: set[str], saved: set[str]) -> bool:
    if ".experts" in module:
        return module[module.find(".experts") + 1 :] in expected
    base = module.rsplit(".", 1)[-1]
    return base in expected or base in saved


# -- the pool -----------------------------------------------------------------------------------


def _pool_for(adapter_manager: Any) -> CPULoRAPool:
    assert _state is not None
    _state.adapter_manager = adapter_manager
    if _state.pool is None:
        capacity = pool_capacity(_state.settings, adapter_manager)
        _state.pool = CPULoRAPool(
            capacity,
            allocator=_state.allocator,
            on_change=lambda s: _publish(s),
            can_evict=_can_evict,
            on_evict=_evicted,
        )
        logger.info("CPU LoRA pool: %.2f GiB for LoRA adapters", capacity / 2**30)
        _publish()
    return _state.pool


def pool_capacity(settings: PatchSettings, adapter_manager: Any) -> int:
    """Bytes from the settings; else max_cpu_loras times the largest adapter the model takes."""
    if settings.lora_pool_bytes:
        return settings.lora_pool_bytes
    count = settings.max_cpu_loras or adapter_manager.lora_config.max_cpu_loras or 1
    return count * max_adapter_bytes(adapter_manager)


def max_adapter_bytes(adapter_manager: Any) -> int:
    """One adapter at max_lora_rank on every LoRA module: the engine's per-slot LoRA buffers."""
    total = 0
    for module in adapter_manager.modules.values():
        for attr, value in vars(module).items():
            if not attr.endswith(("lora_a_stacked", "lora_b_stacked")):
                continue  # the MoE layer's list of per-expert views repeats the tuples' bytes
            tensors = [value] if isinstance(value, torch.Tensor) else (list(value) if isinstance(value, tuple) else [])
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return max(1, math.ceil(total / max(adapter_manager.lora_slots, 1)))


def _can_evict(key: Any) -> bool:
    assert _state is not None
    loading = getattr(_local, "loading", None)
    in_load = loading is not None and loading[1].lora_int_id == key[0]
    return key[0] not in _state.step_ids and not in_load


def _evicted(key: Any) -> None:
    """The pool evicted ``key``: vLLM must forget the adapter, whose slots are about to be reused."""
    assert _state is not None
    if _state.current.get(key[0]) != key:
        return  # vLLM never accepted it, or already replaced it
    del _state.current[key[0]]
    if torch.cuda.is_initialized():  # an async copy out of the old slots may still be running
        torch.cuda.current_stream().synchronize()
    manager = _state.adapter_manager
    if manager is not None:
        manager.remove_adapter(key[0])


def _publish(s: PoolStats | None = None) -> None:
    if _state is None or _state.pool is None:
        return
    values: dict[str, Any] = (s or _state.pool.stats()).as_dict()
    values["load_seconds"] = {str(k): round(v, 4) for k, v in _state.load_seconds.items()}
    stats.publish("lora_pool", values)


def _warn_once(key: str, msg: str, *args: object) -> None:
    if _state is not None and key not in _state.warned:
        _state.warned.add(key)
        logger.warning(msg, *args)
