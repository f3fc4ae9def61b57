"""vLLM's sleep (``CuMemAllocator.sleep`` / ``wake_up`` in vLLM 0.32) through the sleep pool.

vLLM backs each kept allocation up into freshly allocated pinned memory and copies it with a
blocking ``cudaMemcpy``, one allocation at a time, unmapping as it goes. Here the backups are
slices of the pool (``engine_patches.sleep_pool``), all copies go on one side stream with a single
wait, and nothing is unmapped until every copy has finished: a failed copy leaves the engine awake
and whole. When the pool cannot take the memory (pin budget, RAM), that sleep goes vLLM's own way,
counted and logged; a wake restores either kind of backup.

Installed only where vLLM's cumem allocator exists (CUDA); ROCm keeps vLLM's path, which differs
there (placeholder reservations, zeroed pages).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from engine_patches import stats
from engine_patches.pinned import PinnedAllocator
from engine_patches.settings import PatchSettings
from engine_patches.sleep_pool import GIB, CudaMover, SleepPool, SleepStats
from engine_patches.vllm_adapters.patching import wrap

logger = logging.getLogger("engine_patches.sleep_pool")

DEFERRABLE = ("weights", "kv_cache")  # vllm.device_allocator.DEFERRABLE_TAGS in 0.32


def _empty_device_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def pooled_sleep(
    allocator: Any,
    offload_tags: tuple[str, ...] | str | None,
    pool: SleepPool,
    ops: Any,
    fallback: Callable[[Any, Any], None],
) -> None:
    """What ``CuMemAllocator.sleep`` does, with the pool's memory and one wait for all copies.

    ``ops``: ``unmap_and_release(handle)`` (vLLM's cumem module, or a stand-in in tests).
    """
    if offload_tags is None:
        tags: tuple[str, ...] = ("default",)
    elif isinstance(offload_tags, str):
        tags = (offload_tags,)
    else:
        tags = tuple(offload_tags)

    t0 = time.perf_counter()
    total = 0
    keep: list[tuple[int, Any]] = []
    drop: list[Any] = []
    conflict = False
    held: set[int] = set()
    for ptr, data in allocator.pointer_to_data.items():
        if data.is_asleep:
            if (data.tag in tags) != (data.cpu_backup_tensor is not None):
                conflict = True
            if data.cpu_backup_tensor is not None:
                held.add(ptr)
            continue
        total += data.handle[1]
        if data.tag in tags:
            keep.append((ptr, data))
        drop.append(data)

    backups = pool.reserve([(ptr, data.handle[1]) for ptr, data in keep], held)
    if isinstance(backups, str):
        pool.fell_back(backups)
        fallback(allocator, offload_tags)
        pool.record("sleep", sum(data.handle[1] for _, data in keep), time.perf_counter() - t0)
        return

    _synchronize()
    # Every copy is done before anything is unmapped (cuMemUnmap waits for the device anyway):
    # a copy that fails leaves the engine awake and whole.
    try:
        for (ptr, data), backup in zip(keep, backups, strict=True):
            pool.mover.start(backup.data_ptr(), ptr, data.handle[1])
    finally:
        pool.mover.wait()
    for (_, data), backup in zip(keep, backups, strict=True):
        data.cpu_backup_tensor = backup
    for data in drop:
        try:
            ops.unmap_and_release(data.handle)
        finally:
            data.is_asleep = True
    kept = sum(data.handle[1] for _, data in keep)
    pool.record("sleep", kept, time.perf_counter() - t0)
    logger.info(
        "sleep pool: sleep freed %.2f GiB of GPU memory, %.2f GiB of it backed up in the pool "
        "(%.2f GiB discarded) in %.2f s",
        total / GIB,
        kept / GIB,
        (total - kept) / GIB,
        time.perf_counter() - t0,
    )
    if conflict:
        logger.warning(
            "CuMemAllocator: sleep cannot change the policy of already-asleep allocations; the existing policy was kept."
        )
    gc.collect()
    _empty_device_cache()


def pooled_wake_up(allocator: Any, tags: list[str] | None, pool: SleepPool, ops: Any) -> None:
    """What ``CuMemAllocator.wake_up`` does on CUDA, with every copy on the pool's stream."""
    t0 = time.perf_counter()
    gc.collect()
    _empty_device_cache()
    moved = 0
    restored: list[Any] = []
    keys: list[int] = []
    try:
        for ptr, data in allocator.pointer_to_data.items():
            if not data.is_asleep:
                continue
            if tags is None or data.tag in tags or data.tag not in DEFERRABLE:
                ops.create_and_map(data.handle)
                data.is_asleep = False
                backup = data.cpu_backup_tensor
                if backup is not None:
                    # copied while the next allocations are mapped
                    nbytes = backup.numel() * backup.element_size()
                    pool.mover.start(ptr, backup.data_ptr(), nbytes)
                    moved += nbytes
                    restored.append(data)
                    keys.append(ptr)
    finally:
        # Whatever happened, the copies queued so far finish, and what they restored is settled.
        pool.mover.wait()
        pool.release(keys)
        for data in restored:
            data.cpu_backup_tensor = None
    pool.record("wake", moved, time.perf_counter() - t0)
    logger.info("sleep pool: wake restored %.2f GiB in %.2f s", moved / GIB, time.perf_counter() - t0)


def prepare_in_background(allocator: Any, pool: SleepPool) -> threading.Thread:
    """Take the pool for the weights just loaded on a thread of its own, while vLLM profiles memory
    and captures graphs, so that the first sleep only copies."""
    nbytes = sum(d.handle[1] for d in allocator.pointer_to_data.values() if d.tag == "weights" and not d.is_asleep)
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            pool.prepare(nbytes)
        except Exception:  # the first sleep then takes the memory itself
            logger.exception("sleep pool: preparing the pool failed")

    thread = threading.Thread(target=run, name="sleep-pool-prepare", daemon=True)
    thread.start()
    _threads.append(thread)
    return thread


_threads: list[threading.Thread] = []


def wait_for_prepare() -> None:
    """Block until every background prepare has finished (before vLLM captures CUDA graphs)."""
    while _threads:
        thread = _threads.pop()
        if thread.is_alive():
            t0 = time.perf_counter()
            thread.join()
            logger.info("sleep pool: waited %.1f s for the pool before CUDA graph capture", time.perf_counter() - t0)


def install(settings: PatchSettings, allocator: PinnedAllocator) -> list[str]:
    try:
        from vllm.device_allocator import cumem
        from vllm.platforms import current_platform
    except Exception as exc:
        logger.info("sleep pool: vLLM's cumem allocator cannot be imported (%s); not installed", exc)
        return []
    if not cumem.cumem_available or current_platform.is_rocm():
        logger.info("sleep pool: this platform has no CUDA cumem allocator; vLLM's own sleep path stays")
        return []

    def publish(s: SleepStats) -> None:
        stats.publish("sleep_pool", s.as_dict())

    pool = SleepPool(allocator, CudaMover(), publish=publish)
    ops = SimpleNamespace(
        unmap_and_release=lambda handle: cumem.unmap_and_release(handle),
        create_and_map=lambda handle: cumem.create_and_map(handle),
    )
    _state["pool"] = pool
    patched = []

    def make_sleep(original: Callable[..., Any]) -> Callable[..., Any]:
        def sleep(self: Any, offload_tags: tuple[str, ...] | str | None = None) -> None:
            pooled_sleep(self, offload_tags, pool, ops, original)

        return sleep

    def make_wake(original: Callable[..., Any]) -> Callable[..., Any]:
        def wake_up(self: Any, tags: list[str] | None = None) -> None:
            pooled_wake_up(self, tags, pool, ops)

        return wake_up

    def make_use(original: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        def use_memory_pool(self: Any, tag: str | None = None) -> Iterator[None]:
            with original(self, tag):
                yield
            if tag == "weights" and settings.sleep_pool_prepare:
                prepare_in_background(self, pool)

        return use_memory_pool

    def make_warm_up(original: Callable[..., Any]) -> Callable[..., Any]:
        def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            wait_for_prepare()  # pinning while CUDA graphs are captured would break the capture
            return original(self, *args, **kwargs)

        return compile_or_warm_up_model

    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception as exc:  # without the hook a background prepare could meet a graph capture
        logger.warning(
            "sleep pool: vLLM's GPU worker cannot be imported (%s); the pool is taken at the first sleep", exc
        )
        settings = replace(settings, sleep_pool_prepare=False)
    else:
        if wrap(Worker, "compile_or_warm_up_model", make_warm_up):
            patched.append("Worker.compile_or_warm_up_model")
    if wrap(cumem.CuMemAllocator, "use_memory_pool", make_use):
        patched.append("CuMemAllocator.use_memory_pool")
    if wrap(cumem.CuMemAllocator, "sleep", make_sleep):
        patched.append("CuMemAllocator.sleep")
    if wrap(cumem.CuMemAllocator, "wake_up", make_wake):
        patched.append("CuMemAllocator.wake_up")
    publish(pool.stats)
    return patched


_state: dict[str, SleepPool] = {}


def current_pool() -> SleepPool | None:
    """The process's pool once installed (for tests and the benchmark)."""
    return _state.get("pool")
