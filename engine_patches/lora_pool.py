"""CPU LoRA pool: many adapters in bounded, pinned host memory, reused without re-pinning.

Slabs are taken once from the exact-size pinned allocator, one slab per (shape, dtype) class
holding several slots; ``allocate`` hands out a slot, ``deallocate`` gives it back. An adapter's
tensors are filled in place (straight from the checkpoint, MoE experts written into their final
stacked layout), so there is no pin, stack, pin-again chain and no per-tensor pinning cost. When
the pool is full the least recently used adapter that is not pinned is evicted; an adapter larger
than the whole pool gets a clear error instead of an out-of-memory kill.

Torch only; no vllm.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch

from engine_patches.pinned import PinnedAllocator, default_allocator

logger = logging.getLogger("engine_patches.lora_pool")

TensorSpec = tuple[tuple[int, ...], torch.dtype]


class PoolFullError(MemoryError):
    """No room, and every resident adapter is pinned (or in use)."""


class AdapterTooLargeError(ValueError):
    """The adapter needs more bytes than the whole pool has."""


@dataclass
class PoolStats:
    capacity_bytes: int
    slabs: int = 0
    reserved_bytes: int = 0  # bytes held in slabs
    used_bytes: int = 0  # bytes in slots handed out
    free_bytes: int = 0  # capacity not used by slots handed out
    adapters_resident: int = 0
    adapters_pinned: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Slab:
    def __init__(self, key: TensorSpec, storage: torch.Tensor) -> None:
        self.key = key
        self.storage = storage  # [slots, *shape]
        self.free = list(range(storage.shape[0] - 1, -1, -1))

    @property
    def slots(self) -> int:
        return self.storage.shape[0]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


class PooledLoRALayerWeights:
    """One module's LoRA A and B living in pool slots; ``release()`` gives them back."""

    def __init__(self, module_name: str, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 pool: CPULoRAPool) -> None:
        self.module_name = module_name
        self.lora_a = lora_a
        self.lora_b = lora_b
        self._pool: CPULoRAPool | None = pool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b))

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.deallocate(self.lora_a)
            pool.deallocate(self.lora_b)

    def __del__(self) -> None:  # safety net only: eviction and removal release explicitly
        try:
            self.release()
        except Exception:
            pass


@dataclass
class PooledAdapter:
    adapter_id: int | str
    layers: dict[str, PooledLoRALayerWeights]
    nbytes: int
    pinned: bool = False

    def release(self) -> None:
        for layer in self.layers.values():
            layer.release()


class CPULoRAPool:
    def __init__(self, capacity_bytes: int, *, allocator: PinnedAllocator | None = None,
                 slab_bytes: int = 64 << 20,
                 on_change: Callable[[PoolStats], None] | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = slab_bytes
        self.allocator = allocator or default_allocator()
        self.on_change = on_change
        self._lock = threading.RLock()
        self._slabs: dict[TensorSpec, list[_Slab]] = {}
        self._owner: dict[int, tuple[_Slab, int]] = {}  # data_ptr -> (slab, slot)
        self._adapters: OrderedDict[int | str, PooledAdapter] = OrderedDict()  # LRU first
        self._stats = PoolStats(capacity_bytes=capacity_bytes, free_bytes=capacity_bytes)

    # -- tensors ------------------------------------------------------------------------------

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A slot of exactly ``shape``/``dtype``; PoolFullError when no slab can take it."""
        key = (tuple(int(s) for s in shape), dtype)
        with self._lock:
            slab = next((s for s in self._slabs.get(key, []) if s.free), None)
            if slab is None:
                slab = self._new_slab(key)
            slot = slab.free.pop()
            tensor = slab.storage[slot]
            self._owner[tensor.data_ptr()] = (slab, slot)
            self._stats.used_bytes += tensor.numel() * tensor.element_size()
        self._changed()
        return tensor

    def deallocate(self, tensor: torch.Tensor) -> None:
        with self._lock:
            owner = self._owner.pop(tensor.data_ptr(), None)
            if owner is None:
                raise ValueError("this tensor was not allocated by this pool (or was given back)")
            slab, slot = owner
            slab.free.append(slot)
            self._stats.used_bytes -= tensor.numel() * tensor.element_size()
        self._changed()

    def _new_slab(self, key: TensorSpec, slots_wanted: int | None = None) -> _Slab:
        shape, dtype = key
        slot_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if slots_wanted is not None:  # sized for one adapter's load: no partly used slabs
            storage = self.allocator.empty((slots_wanted, *shape), dtype)
            return self._add_slab(key, storage)
        room = self.capacity_bytes - self._stats.reserved_bytes
        if room < slot_bytes:
            self._drop_empty_slabs(except_key=key)  # other shapes' idle slabs make room
            room = self.capacity_bytes - self._stats.reserved_bytes
        # A slab is at most 1/16 of the pool, so one shape cannot hold the others' room hostage.
        slab_bytes = min(self.slab_bytes, max(slot_bytes, self.capacity_bytes // 16))
        slots = min(max(1, slab_bytes // slot_bytes), room // slot_bytes)
        if slots < 1:
            raise PoolFullError(f"no room for a {list(shape)} {dtype} tensor: the pool's "
                                f"{self.capacity_bytes} bytes are in use")
        storage = self.allocator.empty((slots, *shape), dtype)  # taken once, reused after
        return self._add_slab(key, storage)

    def _add_slab(self, key: TensorSpec, storage: torch.Tensor) -> _Slab:
        slab = _Slab(key, storage)
        self._slabs.setdefault(key, []).append(slab)
        self._stats.slabs += 1
        self._stats.reserved_bytes += slab.nbytes
        return slab

    def _drop_empty_slabs(self, except_key: TensorSpec | None = None,
                          keep: set[TensorSpec] = frozenset()) -> None:
        for key, slabs in self._slabs.items():
            if key == except_key or key in keep:
                continue
            for slab in [s for s in slabs if len(s.free) == s.slots]:
                slabs.remove(slab)
                self._stats.slabs -= 1
                self._stats.reserved_bytes -= slab.nbytes

    # -- adapters -----------------------------------------------------------------------------

    def load(self, adapter_id: int | str, modules: Mapping[str, tuple[TensorSpec, TensorSpec]],
             fill: Callable[[str, torch.Tensor, torch.Tensor], None], *,
             pinned: bool = False) -> PooledAdapter:
        """Make room, take slots for every module's (A, B), and let ``fill`` write them.

        ``fill(module_name, lora_a, lora_b)`` reads the checkpoint straight into the slots.
        """
        need = sum(math.prod(a[0]) * _itemsize(a[1]) + math.prod(b[0]) * _itemsize(b[1])
                   for a, b in modules.values())
        if need > self.capacity_bytes:
            raise AdapterTooLargeError(
                f"LoRA adapter {adapter_id!r} needs {need / 2**30:.2f} GiB but the CPU LoRA pool "
                f"holds {self.capacity_bytes / 2**30:.2f} GiB in all: raise lora_pool_bytes (or "
                f"max_cpu_loras) in the offload profile, or use a smaller rank")
        with self._lock:
            self.remove(adapter_id)
            self._reserve(Counter(_key(spec) for pair in modules.values() for spec in pair))
            layers: dict[str, PooledLoRALayerWeights] = {}
            try:
                for name, (spec_a, spec_b) in modules.items():
                    a = self.allocate(*spec_a)
                    b = self.allocate(*spec_b)
                    layers[name] = PooledLoRALayerWeights(name, a, b, self)
                    fill(name, a, b)
            except BaseException:
                for layer in layers.values():
                    layer.release()
                raise
            adapter = PooledAdapter(adapter_id, layers, need, pinned)
            self._adapters[adapter_id] = adapter
            self._count_adapters()
        self._changed()
        return adapter

    def _reserve(self, need: Counter[TensorSpec]) -> None:
        """Make sure free slots exist for ``need``, adding slabs and evicting LRU adapters."""
        while True:
            missing = {k: n - sum(len(s.free) for s in self._slabs.get(k, []))
                       for k, n in need.items()}
            missing = {k: n for k, n in missing.items() if n > 0}
            missing_bytes = sum(n * _nbytes(k) for k, n in missing.items())
            if self._stats.reserved_bytes + missing_bytes > self.capacity_bytes:
                self._drop_empty_slabs(keep=set(need))
            if self._stats.reserved_bytes + missing_bytes <= self.capacity_bytes:
                for key, n in missing.items():
                    self._new_slab(key, slots_wanted=n)
                return
            victim = next((a for a in self._adapters.values() if not a.pinned), None)
            if victim is None:
                raise PoolFullError(
                    "the CPU LoRA pool is full and every resident adapter is pinned: unpin "
                    "one or raise lora_pool_bytes")
            logger.info("CPU LoRA pool full: evicting adapter %r", victim.adapter_id)
            self._stats.evictions += 1
            self.remove(victim.adapter_id)

    def get(self, adapter_id: int | str) -> PooledAdapter | None:
        """The resident adapter (counted as a hit and made most recent), or None (a miss)."""
        with self._lock:
            adapter = self._adapters.get(adapter_id)
            if adapter is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
                self._adapters.move_to_end(adapter_id)
        self._changed()
        return adapter

    def pin(self, adapter_id: int | str, pinned: bool = True) -> None:
        with self._lock:
            if adapter_id not in self._adapters:
                raise KeyError(f"LoRA adapter {adapter_id!r} is not in the CPU pool")
            self._adapters[adapter_id].pinned = pinned
            self._count_adapters()
        self._changed()

    def remove(self, adapter_id: int | str) -> bool:
        with self._lock:
            adapter = self._adapters.pop(adapter_id, None)
            if adapter is None:
                return False
            adapter.release()
            self._count_adapters()
        self._changed()
        return True

    def resident(self) -> list[int | str]:
        with self._lock:
            return list(self._adapters)

    def stats(self) -> PoolStats:
        with self._lock:
            s = PoolStats(**asdict(self._stats))
        s.free_bytes = s.capacity_bytes - s.used_bytes
        return s

    def _count_adapters(self) -> None:
        self._stats.adapters_resident = len(self._adapters)
        self._stats.adapters_pinned = sum(a.pinned for a in self._adapters.values())

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.stats())
            except Exception:
                logger.exception("LoRA pool stats callback failed")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _key(spec: TensorSpec) -> TensorSpec:
    return tuple(int(s) for s in spec[0]), spec[1]


def _nbytes(key: TensorSpec) -> int:
    return math.prod(key[0]) * _itemsize(key[1])
