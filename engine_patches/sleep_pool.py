"""A host-memory pool for the weights an engine backs up when it sleeps (vLLM sleep level 1).

vLLM copies every allocation it keeps into ``torch.empty(..., pin_memory=True)`` at each sleep:
``cudaHostAlloc`` costs about 0.5 s per GiB, far more than the copy (about 1 s for 57 GB at
55 GB/s), and torch's caching host allocator then keeps those blocks, rounded up to a power of two.
This pool takes the memory once, from the exact-size pinned allocator (``cudaHostRegister`` in
chunks, about 0.09 s per GiB), and hands out slices of it at every later sleep. A backup copy never
crosses a registration chunk (CUDA refuses such a copy), so slices are placed inside chunks.

The pool is kept for the engine's life: once an engine has slept, it holds one copy of what it
backs up (its weights, plus the small runtime and CUDA-graph pools) in host RAM, awake or asleep.

Torch only; the vLLM side is ``vllm_adapters.sleep_pool``. Without CUDA it runs on plain memory,
which is how its tests run.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import torch

from engine_patches.pinned import PinnedAllocator

logger = logging.getLogger("engine_patches.sleep_pool")

GIB = 1 << 30
# Slices start on this boundary: page-aligned host memory copies at full speed.
ALIGN = 4096
# Keep this much RAM free when the pool grows, so the pool never pushes the host into swap or OOM.
RAM_RESERVE_BYTES = 2 * GIB


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Slice:
    region: int
    offset: int
    nbytes: int


def place(
    sizes: Sequence[int],
    capacities: Sequence[int],
    held: Sequence[Sequence[tuple[int, int]]],
    chunk_bytes: int,
) -> tuple[list[Slice | None], int]:
    """Where each backup goes: first fit, in order, into the free gaps of the existing regions.

    ``held[r]`` lists the (offset, nbytes) ranges of region ``r`` still in use. A slice never
    crosses a multiple of ``chunk_bytes`` (one registration). Returns one placement per size
    (None when it fits nowhere) and the size of a new region that would hold all the unplaced ones,
    laid out the same way. Pure.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    for n in sizes:
        if n > chunk_bytes:
            raise ValueError(f"a backup of {n} bytes is larger than one registration chunk ({chunk_bytes} bytes)")
    gaps: list[list[tuple[int, int]]] = []  # per region: free (start, end) ranges, in order
    for r, cap in enumerate(capacities):
        used = sorted(held[r]) if r < len(held) else []
        free, at = [], 0
        for off, n in used:
            if off > at:
                free.append((at, off))
            at = max(at, off + n)
        if at < cap:
            free.append((at, cap))
        gaps.append(free)

    out: list[Slice | None] = []
    unplaced: list[int] = []
    for n in sizes:
        spot = None
        for r, free in enumerate(gaps):
            for i, (start, end) in enumerate(free):
                pos = _fit(start, end, n, chunk_bytes)
                if pos is not None:
                    spot = Slice(r, pos, n)
                    tail = (_round_up(pos + n, ALIGN), end)
                    free[i : i + 1] = [g for g in ((start, pos), tail) if g[1] > g[0]]
                    break
            if spot is not None:
                break
        out.append(spot)
        if spot is None:
            unplaced.append(n)

    extra = 0
    for n in unplaced:
        pos = _fit(extra, extra + n + chunk_bytes, n, chunk_bytes)
        assert pos is not None
        extra = _round_up(pos + n, ALIGN)
    return out, extra


def _fit(start: int, end: int, n: int, chunk_bytes: int) -> int | None:
    at = _round_up(start, ALIGN)
    if at // chunk_bytes != (at + n - 1) // chunk_bytes:
        at = _round_up(at, chunk_bytes)  # would cross a chunk: start at the next one
    return at if at + n <= end else None


class Mover(Protocol):
    """Copies between host and device memory; pointers are plain integers.

    ``start`` queues one copy and returns at once, so the caller can map or unmap other memory
    while it runs; ``wait`` returns when every queued copy is done.
    """

    def start(self, dst: int, src: int, nbytes: int) -> None: ...
    def wait(self) -> None: ...


class CudaMover:
    """``cudaMemcpyAsync`` on a stream of its own, one wait at the end.

    The caller makes the device idle first (vLLM's worker synchronizes before it sleeps), so the
    copies see every earlier write.
    """

    _DEFAULT_KIND = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses

    def __init__(self) -> None:
        self._fn: Callable[..., int] | None = None
        self._lib: ctypes.CDLL | None = None
        self._stream: torch.cuda.Stream | None = None

    def _ready(self) -> tuple[Callable[..., int], torch.cuda.Stream]:
        if self._fn is None or self._stream is None:
            with open("/proc/self/maps") as maps:
                paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
            if not paths:
                raise RuntimeError("no CUDA runtime is loaded in this process")
            major = (torch.version.cuda or "").split(".")[0]
            paths.sort(key=lambda p: f"libcudart.so.{major}" not in p)  # torch's own runtime first
            self._lib = ctypes.CDLL(paths[0])
            fn = self._lib.cudaMemcpyAsync
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._fn, self._stream = fn, torch.cuda.Stream()
        return self._fn, self._stream

    def start(self, dst: int, src: int, nbytes: int) -> None:
        fn, stream = self._ready()
        code = fn(dst, src, nbytes, self._DEFAULT_KIND, ctypes.c_void_p(stream.cuda_stream))
        if code != 0:
            stream.synchronize()
            if self._lib is not None:
                self._lib.cudaGetLastError()  # else torch's next error check would report this one
            raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes failed with CUDA error {code}")

    def wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


@dataclass
class SleepStats:
    """What the dashboard shows of a worker's sleeps (bytes held now, then counters since start)."""

    pool_bytes: int = 0  # host memory the pool holds (pinned where possible), awake or asleep
    slept_bytes: int = 0  # of it, backups of a sleep that has not been woken yet
    sleeps: int = 0
    wakes: int = 0
    fallbacks: int = 0  # sleeps that went vLLM's own way (pin budget or RAM said no, or no CUDA)
    grown: int = 0  # times the pool took more memory (the first sleep counts once)
    last_sleep_s: float | None = None
    last_sleep_bytes: int = 0
    last_sleep_gbps: float | None = None
    last_wake_s: float | None = None
    last_wake_bytes: int = 0
    last_wake_gbps: float | None = None
    last_fallback: str | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 and nbytes else None


def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class SleepPool:
    """Slices of long-lived host memory, one per backed-up allocation, keyed by device address."""

    def __init__(
        self,
        allocator: PinnedAllocator,
        mover: Mover,
        *,
        ram_available: Callable[[], int | None] = mem_available_bytes,
        ram_reserve_bytes: int = RAM_RESERVE_BYTES,
        publish: Callable[[SleepStats], None] | None = None,
    ) -> None:
        self.allocator = allocator
        self.mover = mover
        self.ram_available = ram_available
        self.ram_reserve_bytes = ram_reserve_bytes
        self.publish = publish
        self.regions: list[torch.Tensor] = []
        self.live: dict[int, Slice] = {}  # device address -> its backup's slice
        self._counts = SleepStats()  # counters and last times; the byte figures come from the pool
        self._lock = threading.Lock()

    @property
    def stats(self) -> SleepStats:
        return replace(
            self._counts,
            pool_bytes=sum(int(r.numel()) for r in self.regions),
            slept_bytes=sum(s.nbytes for s in list(self.live.values())),  # list(): one step under the GIL
        )

    # -- sleeping ---------------------------------------------------------------------------

    def reserve(self, wanted: Sequence[tuple[int, int]], still_held: set[int]) -> list[torch.Tensor] | str:
        """Host tensors for ``wanted`` (device address, nbytes), or the reason there are none.

        ``still_held``: addresses whose backups are still in use (asleep, not yet woken); every
        other slice is free again.
        """
        with self._lock:
            self.live = {k: s for k, s in self.live.items() if k in still_held}
            held: list[list[tuple[int, int]]] = [[] for _ in self.regions]
            for s in self.live.values():
                held[s.region].append((s.offset, s.nbytes))

            def layout() -> tuple[list[Slice | None], int]:
                sizes = [n for _, n in wanted]
                return place(sizes, [int(r.numel()) for r in self.regions], held, self.allocator.chunk_bytes)

            try:
                spots, extra = layout()
            except ValueError as exc:
                return str(exc)
            if extra:
                why = self._grow(extra)
                if why:
                    return why
                spots, extra = layout()  # the new region, last, takes what did not fit before
                assert extra == 0
            out = []
            for (key, _), spot in zip(wanted, spots, strict=True):
                assert spot is not None
                self.live[key] = spot
                out.append(self.regions[spot.region][spot.offset : spot.offset + spot.nbytes])
            return out

    def _grow(self, nbytes: int) -> str | None:
        if not self.allocator.pinning_available():
            return "no CUDA runtime to pin host memory"
        available = self.ram_available()
        if available is not None and available < nbytes + self.ram_reserve_bytes:
            return (
                f"the pool needs {nbytes / GIB:.2f} GiB more host RAM and only {available / GIB:.2f} GiB is "
                f"available ({self.ram_reserve_bytes / GIB:.0f} GiB is kept free)"
            )
        region, why = self.allocator.allocate_pinned(nbytes)
        if region is None:
            return f"{nbytes / GIB:.2f} GiB could not be pinned ({why})"
        self.regions.append(region)
        self._counts.grown += 1
        logger.info(
            "sleep pool: took %.2f GiB of pinned host memory (%.2f GiB in all)",
            nbytes / GIB,
            self.stats.pool_bytes / GIB,
        )
        return None

    def prepare(self, nbytes: int) -> None:
        """Take ``nbytes`` now (after the weights load, off the engine's path), so that even the first
        sleep only copies. A refusal here is logged; the first sleep then tries again or falls back."""
        with self._lock:
            missing = nbytes - sum(int(r.numel()) for r in self.regions)
            if missing <= 0:
                return
            t0 = time.perf_counter()
            why = self._grow(_round_up(missing, ALIGN))
        if why:
            logger.warning("sleep pool: not prepared ahead of the first sleep: %s", why)
        else:
            logger.info("sleep pool: prepared %.2f GiB in %.1f s", missing / GIB, time.perf_counter() - t0)
        self._publish()

    # -- waking -----------------------------------------------------------------------------

    def release(self, keys: Sequence[int]) -> None:
        """The backups of ``keys`` are back on the device: their slices are free."""
        with self._lock:
            for key in keys:
                self.live.pop(key, None)

    def fell_back(self, reason: str) -> None:
        with self._lock:
            self._counts.fallbacks += 1
            self._counts.last_fallback = reason
        logger.warning("sleep pool: this sleep goes vLLM's own way (pinned memory allocated now): %s", reason)
        self._publish()

    def record(self, what: str, nbytes: int, seconds: float) -> None:
        """A whole sleep or wake: its time and the bytes it copied."""
        with self._lock:
            s = self._counts
            if what == "sleep":
                s.sleeps += 1
                s.last_sleep_s, s.last_sleep_bytes, s.last_sleep_gbps = (
                    round(seconds, 4),
                    nbytes,
                    _gbps(nbytes, seconds),
                )
            else:
                s.wakes += 1
                s.last_wake_s, s.last_wake_bytes, s.last_wake_gbps = round(seconds, 4), nbytes, _gbps(nbytes, seconds)
        self._publish()

    def _publish(self) -> None:
        if self.publish is not None:
            try:
                self.publish(self.stats)
            except Exception:  # stats must never break a sleep
                logger.exception("sleep pool stats callback failed")
