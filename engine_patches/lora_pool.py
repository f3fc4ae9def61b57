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

import contextlib
import io
import json
import logging
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Set
from dataclasses import asdict, dataclass

import torch

from engine_patches.pinned import PinnedAllocator, default_allocator

logger = logging.getLogger("engine_patches.lora_pool")

TensorSpec = tuple[tuple[int, ...], torch.dtype]
AdapterId = Hashable  # any key: the vLLM adapter keys by (lora_int_id, load number)


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

    def __init__(self, module_name: str, lora_a: torch.Tensor, lora_b: torch.Tensor, pool: CPULoRAPool) -> None:
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
        with contextlib.suppress(Exception):
            self.release()


@dataclass
class PooledAdapter:
    adapter_id: AdapterId
    layers: dict[str, PooledLoRALayerWeights]
    nbytes: int
    pinned: bool = False

    def release(self) -> None:
        for layer in self.layers.values():
            layer.release()


class CPULoRAPool:
    """Slabs of pinned memory handed out as adapter tensors, with LRU eviction of adapters.

    ``can_evict(adapter_id)`` lets the owner protect adapters the pool cannot see are in use
    (vLLM's current batch); ``on_evict(adapter_id)`` runs after the pool evicted one, so the
    owner can drop its own references (vLLM's CPU LoRA cache) in the same step.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        allocator: PinnedAllocator | None = None,
        slab_bytes: int = 64 << 20,
        on_change: Callable[[PoolStats], None] | None = None,
        can_evict: Callable[[AdapterId], bool] | None = None,
        on_evict: Callable[[AdapterId], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = slab_bytes
        self.allocator = allocator or default_allocator()
        self.on_change = on_change
        self.can_evict = can_evict
        self.on_evict = on_evict
        self._lock = threading.RLock()
        self._slabs: dict[TensorSpec, list[_Slab]] = {}
        self._owner: dict[int, tuple[_Slab, int]] = {}  # data_ptr -> (slab, slot)
        self._adapters: OrderedDict[AdapterId, PooledAdapter] = OrderedDict()  # LRU first
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
            raise PoolFullError(
                f"no room for a {list(shape)} {dtype} tensor: the pool's {self.capacity_bytes} bytes are in use"
            )
        storage = self.allocator.empty((slots, *shape), dtype)  # taken once, reused after
        return self._add_slab(key, storage)

    def _add_slab(self, key: TensorSpec, storage: torch.Tensor) -> _Slab:
        slab = _Slab(key, storage)
        self._slabs.setdefault(key, []).append(slab)
        self._stats.slabs += 1
        self._stats.reserved_bytes += slab.nbytes
        return slab

    def _drop_empty_slabs(self, except_key: TensorSpec | None = None, keep: Set[TensorSpec] = frozenset()) -> None:
        for key, slabs in self._slabs.items():
            if key == except_key or key in keep:
                continue
            for slab in [s for s in slabs if len(s.free) == s.slots]:
                slabs.remove(slab)
                self._stats.slabs -= 1
                self._stats.reserved_bytes -= slab.nbytes

    # -- adapters -----------------------------------------------------------------------------

    def load(
        self,
        adapter_id: AdapterId,
        modules: Mapping[str, tuple[TensorSpec, TensorSpec]],
        fill: Callable[[str, torch.Tensor, torch.Tensor], None],
        *,
        pinned: bool = False,
    ) -> PooledAdapter:
        """Make room, take slots for every module's (A, B), and let ``fill`` write them.

        ``fill(module_name, lora_a, lora_b)`` reads the checkpoint straight into the slots.
        """
        need = sum(math.prod(a[0]) * _itemsize(a[1]) + math.prod(b[0]) * _itemsize(b[1]) for a, b in modules.values())
        if need > self.capacity_bytes:
            raise AdapterTooLargeError(
                f"LoRA adapter {adapter_id!r} needs {need / 2**30:.2f} GiB but the CPU LoRA pool "
                f"holds {self.capacity_bytes / 2**30:.2f} GiB in all: raise lora_pool_bytes "
                f"(lora_pool_gib in the offload profile), or use a smaller rank"
            )
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
            missing = {k: n - sum(len(s.free) for s in self._slabs.get(k, [])) for k, n in need.items()}
            missing = {k: n for k, n in missing.items() if n > 0}
            missing_bytes = sum(n * _nbytes(k) for k, n in missing.items())
            if self._stats.reserved_bytes + missing_bytes > self.capacity_bytes:
                self._drop_empty_slabs(keep=set(need))
            if self._stats.reserved_bytes + missing_bytes <= self.capacity_bytes:
                for key, n in missing.items():
                    self._new_slab(key, slots_wanted=n)
                return
            unpinned = [a for a in self._adapters.values() if not a.pinned]
            victim = next((a for a in unpinned if self.can_evict is None or self.can_evict(a.adapter_id)), None)
            if victim is None:
                if not unpinned:
                    raise PoolFullError(
                        "the CPU LoRA pool is full and every resident adapter is pinned: unpin "
                        "one or raise lora_pool_bytes (lora_pool_gib in the offload profile)"
                    )
                raise PoolFullError(
                    f"the CPU LoRA pool ({self.capacity_bytes / 2**30:.2f} GiB) is full with "
                    f"adapters the current batch uses or that are pinned: it cannot hold one "
                    f"batch's adapters (max_loras) plus this one; raise lora_pool_bytes "
                    f"(lora_pool_gib in the offload profile) or lower max_loras"
                )
            logger.info("CPU LoRA pool full: evicting adapter %r", victim.adapter_id)
            self._stats.evictions += 1
            self.remove(victim.adapter_id)
            if self.on_evict is not None:
                self.on_evict(victim.adapter_id)

    def get(self, adapter_id: AdapterId) -> PooledAdapter | None:
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

    def pin(self, adapter_id: AdapterId, pinned: bool = True) -> None:
        with self._lock:
            if adapter_id not in self._adapters:
                raise KeyError(f"LoRA adapter {adapter_id!r} is not in the CPU pool")
            self._adapters[adapter_id].pinned = pinned
            self._count_adapters()
        self._changed()

    def remove(self, adapter_id: AdapterId) -> bool:
        """Give the adapter's slots back; False when it is not resident (already evicted)."""
        with self._lock:
            adapter = self._adapters.pop(adapter_id, None)
            if adapter is None:
                return False
            adapter.release()
            self._count_adapters()
        self._changed()
        return True

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a slot this pool handed out and has not got back."""
        with self._lock:
            return tensor.data_ptr() in self._owner

    def resident(self) -> list[AdapterId]:
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


# -- reading checkpoints straight into slots ----------------------------------------------------
# A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
# dtype, shape and byte range, then the raw bytes. Reading a range with readinto() into a slot
# avoids the full-size intermediate tensor safetensors' own loader makes.

_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


class SafetensorsFile:
    """The index of a safetensors file, and reads of single tensors into given buffers."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        self.tensors: dict[str, StoredTensor] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(
                    f"{path}: tensor {name!r} has dtype {entry['dtype']}, which the "
                    f"CPU LoRA pool does not read; turn lora_pool off for it"
                )
            start, end = entry["data_offsets"]
            self.tensors[name] = StoredTensor(name, dtype, tuple(entry["shape"]), 8 + header_len + start, end - start)
        self._file: io.FileIO | None = None

    def __enter__(self) -> SafetensorsFile:
        self._file = open(self.path, "rb", buffering=0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` (same shape, any dtype) with the stored tensor ``name``."""
        stored = self.tensors[name]
        if tuple(out.shape) != stored.shape:
            raise ValueError(f"{self.path}: {name} is {list(stored.shape)}, the slot is {list(out.shape)}")
        if out.dtype == stored.dtype and out.is_contiguous():
            self._read(stored, out)
        else:  # a cast: one tensor-sized temporary, never the whole file
            staging = torch.empty(stored.shape, dtype=stored.dtype)
            self._read(stored, staging)
            out.copy_(staging)

    def read(self, name: str) -> torch.Tensor:
        stored = self.tensors[name]
        out = torch.empty(stored.shape, dtype=stored.dtype)
        self._read(stored, out)
        return out

    def _read(self, stored: StoredTensor, out: torch.Tensor) -> None:
        if stored.nbytes == 0:
            return
        assert self._file is not None, "use SafetensorsFile as a context manager to read"
        view = out.view(-1).view(torch.uint8).numpy().data  # the slot's bytes, for readinto
        self._file.seek(stored.offset)
        done = 0
        while done < stored.nbytes:
            n = self._file.readinto(view[done:])
            if not n:
                raise ValueError(f"{self.path} ends inside tensor {stored.name}: truncated file")
            done += n
