"""Exact-size pinned host memory.

``Tensor.pin_memory()`` goes through PyTorch's caching host allocator, which rounds every block
up to a power of two and keeps freed blocks: host RAM reaches about 2x the bytes (vLLM #56410).
Here each allocation is a plain anonymous mapping of the size asked (rounded to a page) that is
registered with ``cudaHostRegister`` in chunks of at most ``chunk_bytes``, and unregistered and
unmapped as soon as the last tensor using it is gone.

One copy must not cross a chunk boundary: measured on the H200, a ``cudaMemcpyAsync`` whose source
spans two registrations fails with cudaErrorInvalidValue. So the default chunk (64 GiB, as vLLM's
KV offload region uses) is larger than any tensor copied in one piece; smaller chunks are only for
memory that is copied block by block. Over the optional pin budget, or when registration fails, the memory
stays pageable: that is counted and logged once, because pageable copies are about 6x slower.

Torch only (and numpy, which torch's CPU tensors can wrap); no vllm. Without CUDA everything
works, unpinned.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch

logger = logging.getLogger("engine_patches.pinned")

PAGE = mmap.PAGESIZE
# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every device, and readable in
# place by kernels (vLLM's UVA weight offload needs a device view of the host tensor).
_REGISTER_FLAGS = 0x01 | 0x02


class HostRegistrar(Protocol):
    """Pins and unpins host ranges; the real one calls the CUDA runtime."""

    def available(self) -> bool: ...
    def register(self, ptr: int, nbytes: int) -> int: ...  # 0 on success, else an error code
    def unregister(self, ptr: int) -> None: ...


class CudaHostRegistrar:
    """``cudaHostRegister`` through torch's own CUDA runtime binding.

    Nothing touches CUDA until the first allocation: importing this module never creates a
    context.
    """

    def __init__(self) -> None:
        self._cudart: Any = None  # torch.cuda.cudart(): torch's untyped binding module
        self._checked = False

    def available(self) -> bool:
        if not self._checked:
            self._checked = True
            try:
                if torch.cuda.is_available():
                    self._cudart = torch.cuda.cudart()
            except Exception as exc:  # CPU-only torch, no driver, ...
                logger.info("no CUDA runtime for host registration (%s); memory stays pageable", exc)
                self._cudart = None
        return self._cudart is not None

    def register(self, ptr: int, nbytes: int) -> int:
        err = self._cudart.cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS)
        code = int(getattr(err, "value", err))
        if code != 0:
            _clear_last_cuda_error()
        return code

    def unregister(self, ptr: int) -> None:
        err = self._cudart.cudaHostUnregister(ptr)
        code = int(getattr(err, "value", err))
        if code != 0:
            logger.warning("cudaHostUnregister(%#x) failed with code %d", ptr, code)


def _clear_last_cuda_error() -> None:
    """Reset the runtime's last-error slot after a refused registration.

    Otherwise the next unrelated ``cudaGetLastError`` check (PyTorch does one after each kernel
    launch) would report our harmless failure. torch's binding has no cudaGetLastError, so call
    the libcudart that torch already loaded.
    """
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception as exc:  # best effort: a missing clear only risks a spurious later error
        logger.debug("could not clear the CUDA error state: %s", exc)


@dataclass
class PinnedStats:
    """Live figures (bytes held now) and counters (since start)."""

    asked_bytes: int = 0  # bytes the callers asked for, live
    mapped_bytes: int = 0  # bytes mapped for them (page-rounded), live
    pinned_bytes: int = 0  # of mapped_bytes, the part registered with CUDA
    pageable_bytes: int = 0  # of mapped_bytes, the part left pageable
    allocations: int = 0  # live allocations
    chunks: int = 0  # live cudaHostRegister chunks
    peak_pinned_bytes: int = 0
    pageable_fallbacks: int = 0  # allocations that wanted pinning and did not get it
    over_budget: int = 0  # of those, refused by the pin budget
    register_failures: int = 0  # of those, refused by cudaHostRegister
    total_allocations: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Region(np.ndarray):
    """The root array over one mapping; its ``__del__`` runs when the last tensor view is gone.

    Tensors made with ``torch.from_numpy`` hold a reference to this array (through their
    storage), so unregistering here happens exactly when the memory stops being used, and before
    the mapping itself is unmapped.
    """

    _release: _Release  # set once, right after the mapping is made

    def __del__(self) -> None:
        release = self.__dict__.pop("_release", None) if hasattr(self, "__dict__") else None
        if release is not None:
            release()


class PinnedAllocator:
    """Exact-size host tensors, pinned where possible, under an optional global budget."""

    def __init__(
        self,
        *,
        budget_bytes: int | None = None,
        chunk_bytes: int = 64 << 30,
        registrar: HostRegistrar | None = None,
        on_change: Callable[[PinnedStats], None] | None = None,
    ) -> None:
        if chunk_bytes < PAGE:
            raise ValueError(f"chunk_bytes must be at least one page ({PAGE}), got {chunk_bytes}")
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes - chunk_bytes % PAGE  # chunks never share a page
        self.registrar = registrar if registrar is not None else CudaHostRegistrar()
        self.on_change = on_change
        self._lock = threading.Lock()
        self._stats = PinnedStats()
        self._warned: set[str] = set()

    # -- public API -------------------------------------------------------------------------

    def empty(self, shape: Sequence[int], dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
        """A zero-filled contiguous CPU tensor of exactly ``shape`` and ``dtype``."""
        shape = tuple(int(s) for s in shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        raw = self.allocate_bytes(nbytes, pin=pin)
        return raw.view(dtype).view(shape)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned copy of ``tensor`` (what ``tensor.pin_memory()`` gives, without the 2x)."""
        if tensor.device.type != "cpu":
            raise ValueError(f"can only pin CPU tensors, got one on {tensor.device}")
        out = self.empty(tensor.shape, tensor.dtype)
        out.copy_(tensor)
        return out

    def allocate_bytes(self, nbytes: int, *, pin: bool = True) -> torch.Tensor:
        """A flat uint8 tensor of ``nbytes`` over its own mapping."""
        return self._allocate(nbytes, pin)[0]

    def allocate_pinned(self, nbytes: int) -> tuple[torch.Tensor | None, str | None]:
        """``nbytes`` of pinned memory, or None and why (the pin budget, a refused registration,
        no CUDA); nothing is kept pageable."""
        tensor, why = self._allocate(nbytes, True)
        return (tensor, None) if why is None else (None, why)

    def _allocate(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, str | None]:
        mapped = -(-nbytes // PAGE) * PAGE
        mm = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        root = np.frombuffer(mm, dtype=np.uint8).view(_Region)
        ptr = root.ctypes.data
        chunks, why = self._pin_range(ptr, mapped, nbytes) if pin else (None, "not asked to pin")
        self._account(nbytes, mapped, chunks, +1)
        root._release = _Release(self, nbytes, mapped, chunks)
        return torch.from_numpy(root[:nbytes].view(np.ndarray)), why

    def stats(self) -> PinnedStats:
        with self._lock:
            return PinnedStats(**asdict(self._stats))

    def pinning_available(self) -> bool:
        return self.registrar.available()

    # -- internals --------------------------------------------------------------------------

    def _pin_range(self, ptr: int, mapped: int, nbytes: int) -> tuple[list[int] | None, str | None]:
        """Register ``[ptr, ptr+mapped)`` chunk by chunk; None (and why) means it stays pageable."""
        if not self.registrar.available():
            return None, "no CUDA runtime to pin host memory"  # pageable by design, not a fallback
        with self._lock:
            over = self.budget_bytes is not None and self._stats.pinned_bytes + mapped > self.budget_bytes
            if over:
                self._stats.over_budget += 1
                self._stats.pageable_fallbacks += 1
        if over:
            self._warn_once(
                "budget",
                "pin budget of %d bytes reached: allocations past it stay pageable (about 6x "
                "slower to copy to the GPU); raise pin_budget_bytes in the offload profile",
                self.budget_bytes,
            )
            return None, f"over the pin budget of {self.budget_bytes} bytes"
        done: list[int] = []
        for start in range(0, mapped, self.chunk_bytes):
            size = min(self.chunk_bytes, mapped - start)
            code = self.registrar.register(ptr + start, size)
            if code != 0:
                for chunk_ptr in done:
                    self.registrar.unregister(chunk_ptr)
                with self._lock:
                    self._stats.register_failures += 1
                    self._stats.pageable_fallbacks += 1
                self._warn_once(
                    "register",
                    "cudaHostRegister of %d bytes failed (code %d): the allocation stays "
                    "pageable (about 6x slower to copy); check the memlock limit (ulimit -l)",
                    size,
                    code,
                )
                return None, f"cudaHostRegister refused it (code {code})"
            done.append(ptr + start)
        return done, None

    def _account(self, nbytes: int, mapped: int, chunks: list[int] | None, sign: int) -> None:
        with self._lock:
            s = self._stats
            s.asked_bytes += sign * nbytes
            s.mapped_bytes += sign * mapped
            s.allocations += sign
            if sign > 0:
                s.total_allocations += 1
            if chunks is None:
                s.pageable_bytes += sign * mapped
            else:
                s.pinned_bytes += sign * mapped
                s.chunks += sign * len(chunks)
                s.peak_pinned_bytes = max(s.peak_pinned_bytes, s.pinned_bytes)
            snapshot = PinnedStats(**asdict(s))
        if self.on_change is not None:
            try:
                self.on_change(snapshot)
            except Exception:  # stats must never break an allocation
                logger.exception("pinned stats callback failed")

    def _free(self, nbytes: int, mapped: int, chunks: list[int] | None) -> None:
        if chunks:
            for chunk_ptr in chunks:
                self.registrar.unregister(chunk_ptr)
        self._account(nbytes, mapped, chunks, -1)

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)


class _Release:
    """Called once, from the region's ``__del__``."""

    __slots__ = ("allocator", "nbytes", "mapped", "chunks")

    def __init__(self, allocator: PinnedAllocator, nbytes: int, mapped: int, chunks: list[int] | None) -> None:
        self.allocator, self.nbytes, self.mapped, self.chunks = allocator, nbytes, mapped, chunks

    def __call__(self) -> None:
        self.allocator._free(self.nbytes, self.mapped, self.chunks)


# -- the process-wide allocator ---------------------------------------------------------------
# The plugin configures it from the settings (budget, chunk size, stats); every user in the
# process (LoRA, UVA weight offload, the MoE expert store, the LoRA pool) shares its budget.

_default: PinnedAllocator | None = None
_default_lock = threading.Lock()


def configure_default(**kwargs: object) -> PinnedAllocator:
    """Replace the process-wide allocator (arguments as for ``PinnedAllocator``)."""
    global _default
    with _default_lock:
        _default = PinnedAllocator(**kwargs)  # type: ignore[arg-type]
        return _default


def default_allocator() -> PinnedAllocator:
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = PinnedAllocator()
    return _default


def empty_pinned(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An exact-size pinned tensor from the process-wide allocator (pageable without CUDA)."""
    return default_allocator().empty(shape, dtype)
