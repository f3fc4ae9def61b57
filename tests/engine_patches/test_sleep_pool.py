"""The sleep pool: vLLM's own CuMemAllocator records, with host buffers standing in for GPU memory.

vLLM's CPU build has no sleep mode (no cumem allocator), so the device side here is plain memory
that ``unmap_and_release`` scribbles over, as a real unmap loses it; copies are real memmoves
between those addresses. What a user would see: a slept engine wakes with its weights intact, a
second sleep takes no new memory, and a sleep the pool cannot hold still works, vLLM's own way.
"""

from __future__ import annotations

import ctypes
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_patches.pinned import PinnedAllocator
from engine_patches.sleep_pool import GIB, SleepPool, SleepStats, place
from engine_patches.vllm_adapters import sleep_pool as adapter
from tests.engine_patches.test_pinned import RecordingRegistrar

cumem = pytest.importorskip("vllm.device_allocator.cumem")
from vllm.device_allocator import AllocationData  # noqa: E402

MIB = 1 << 20


class HostMover:
    """Copies with memmove and counts the waits; can be told to fail."""

    def __init__(self) -> None:
        self.started = 0
        self.waits = 0
        self.fail = False
        self.fail_on_wait = False

    def start(self, dst, src, n):
        if self.fail:
            raise RuntimeError("cudaMemcpyAsync failed with CUDA error 700")
        self.started += 1
        ctypes.memmove(dst, src, n)

    def wait(self):
        self.waits += 1
        if self.fail_on_wait:
            raise RuntimeError("an asynchronous copy failed: CUDA error 700")


class FakeDevice:
    """Allocations of the engine: tag -> host buffers that play GPU memory."""

    def __init__(self, sizes_by_tag: dict[str, list[int]], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.allocator = cumem.CuMemAllocator()
        self.buffers: dict[int, torch.Tensor] = {}
        for tag, sizes in sizes_by_tag.items():
            for n in sizes:
                buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
                self.buffers[buf.data_ptr()] = buf
                handle = (0, n, buf.data_ptr(), 0)
                self.allocator.pointer_to_data[buf.data_ptr()] = AllocationData(handle, tag)
        self.original = {p: b.clone() for p, b in self.buffers.items()}
        self.unmapped: list[int] = []
        self.ops = SimpleNamespace(unmap_and_release=self._unmap, create_and_map=self._map)

    def _unmap(self, handle):
        self.buffers[handle[2]].fill_(0xEE)  # what was there is gone
        self.unmapped.append(handle[2])

    def _map(self, handle):
        self.buffers[handle[2]].fill_(0x11)  # fresh physical memory holds junk

    def intact(self, tag: str) -> bool:
        return all(
            torch.equal(self.buffers[p], self.original[p])
            for p, d in self.allocator.pointer_to_data.items()
            if d.tag == tag
        )

    def tagged_bytes(self, tag: str) -> int:
        return sum(d.handle[1] for d in self.allocator.pointer_to_data.values() if d.tag == tag)


def vllm_own_sleep(allocator, offload_tags):
    """vLLM's path as far as it matters here: a fresh host tensor per kept allocation, then unmap."""
    tags = (offload_tags,) if isinstance(offload_tags, str) else offload_tags
    for ptr, data in allocator.pointer_to_data.items():
        if data.is_asleep:
            continue
        if data.tag in tags:
            backup = torch.empty(data.handle[1], dtype=torch.uint8)
            ctypes.memmove(backup.data_ptr(), ptr, data.handle[1])
            data.cpu_backup_tensor = backup
        vllm_own_sleep.device._unmap(data.handle)
        data.is_asleep = True


def make_pool(*, budget: int | None = None, ram: int | None = 64 * GIB, chunk: int = 64 * GIB):
    alloc = PinnedAllocator(registrar=RecordingRegistrar(), budget_bytes=budget, chunk_bytes=chunk)
    published: list[SleepStats] = []
    mover = HostMover()
    pool = SleepPool(alloc, mover, ram_available=lambda: ram, publish=published.append)
    return pool, mover, published


def sleep(dev, pool, tags=("weights", "runtime")):
    vllm_own_sleep.device = dev
    adapter.pooled_sleep(dev.allocator, tags, pool, dev.ops, vllm_own_sleep)


def test_a_slept_engine_wakes_with_its_weights_and_the_second_sleep_takes_no_new_memory():
    dev = FakeDevice({"weights": [3 * MIB, 5 * MIB + 123, 1 * MIB], "runtime": [64 * 1024], "kv_cache": [8 * MIB]})
    pool, mover, published = make_pool()
    weights = dev.tagged_bytes("weights") + dev.tagged_bytes("runtime")

    sleep(dev, pool)
    assert all(d.is_asleep for d in dev.allocator.pointer_to_data.values())
    assert not dev.intact("weights")  # the device memory really was given up
    assert pool.stats.slept_bytes == weights
    # exact size: only the 4 KiB alignment of each slice on top of the bytes kept
    assert weights <= pool.stats.pool_bytes <= weights + 4 * 4096
    assert (mover.started, mover.waits) == (4, 1)  # every copy queued, one wait

    adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)
    assert dev.intact("weights") and dev.intact("runtime")
    assert not dev.intact("kv_cache")  # discarded, as vLLM does at level 1
    assert all(d.cpu_backup_tensor is None and not d.is_asleep for d in dev.allocator.pointer_to_data.values())
    assert pool.stats.slept_bytes == 0

    first_regions = [r.data_ptr() for r in pool.regions]
    for _ in range(3):
        sleep(dev, pool)
        adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)
    assert dev.intact("weights")
    assert [r.data_ptr() for r in pool.regions] == first_regions
    s = published[-1]
    assert (s.sleeps, s.wakes, s.grown, s.fallbacks) == (4, 4, 1, 0)
    assert s.last_sleep_bytes == weights and s.last_wake_bytes == weights
    assert s.last_sleep_s is not None and s.last_wake_s is not None


def test_over_the_pin_budget_the_sleep_goes_vllms_own_way_and_still_wakes_intact(caplog):
    dev = FakeDevice({"weights": [4 * MIB, 4 * MIB]})
    pool, _, published = make_pool(budget=2 * MIB)
    sleep(dev, pool, ("weights",))
    assert all(d.is_asleep for d in dev.allocator.pointer_to_data.values())
    assert pool.stats.fallbacks == 1 and "pin budget" in (pool.stats.last_fallback or "")
    assert pool.stats.pool_bytes == 0 and pool.allocator.stats().pinned_bytes == 0  # nothing kept pageable
    assert "goes vLLM's own way" in caplog.text
    adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)
    assert dev.intact("weights")
    assert published[-1].wakes == 1


def test_short_of_ram_the_pool_does_not_grow_and_says_how_much_was_missing():
    dev = FakeDevice({"weights": [6 * MIB]})
    pool, _, _ = make_pool(ram=3 * GIB)
    pool.ram_reserve_bytes = 3 * GIB  # 3 GiB available, all of it kept free
    sleep(dev, pool, ("weights",))
    assert pool.stats.fallbacks == 1
    assert "only 3.00 GiB is available" in (pool.stats.last_fallback or "")
    adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)
    assert dev.intact("weights")


def test_a_failed_copy_leaves_the_engine_awake_and_whole():
    dev = FakeDevice({"weights": [2 * MIB, 2 * MIB]})
    pool, mover, _ = make_pool()
    mover.fail = True
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        sleep(dev, pool, ("weights",))
    assert dev.unmapped == []
    assert not any(d.is_asleep for d in dev.allocator.pointer_to_data.values())
    assert dev.intact("weights")


def test_a_partial_wake_keeps_the_sleeping_weights_backups_out_of_the_next_sleeps_way():
    dev = FakeDevice({"weights": [3 * MIB, 3 * MIB], "runtime": [1 * MIB]})
    pool, _, _ = make_pool()
    sleep(dev, pool)
    # wake only the KV cache: weights (deferrable) stay asleep, runtime (not deferrable) wakes
    adapter.pooled_wake_up(dev.allocator, ["kv_cache"], pool, dev.ops)
    states = {d.tag: d.is_asleep for d in dev.allocator.pointer_to_data.values()}
    assert states == {"weights": True, "runtime": False}
    assert pool.stats.slept_bytes == 6 * MIB
    dev.buffers[next(p for p, d in dev.allocator.pointer_to_data.items() if d.tag == "runtime")].fill_(7)
    sleep(dev, pool)  # the runtime pool is backed up again, beside the weights still held
    adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)
    assert dev.intact("weights")
    runtime = next(p for p, d in dev.allocator.pointer_to_data.items() if d.tag == "runtime")
    assert bool((dev.buffers[runtime] == 7).all())


def test_an_allocation_freed_while_asleep_gives_its_slice_back():
    dev = FakeDevice({"weights": [4 * MIB, 4 * MIB]})
    pool, _, _ = make_pool()
    sleep(dev, pool, ("weights",))
    gone = next(iter(dev.allocator.pointer_to_data))
    dev.allocator.pointer_to_data.pop(gone)  # vLLM's free callback while asleep
    adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)
    extra = FakeDevice({"weights": [4 * MIB]}, seed=1)  # a new allocation of the same size
    for ptr, data in extra.allocator.pointer_to_data.items():
        dev.allocator.pointer_to_data[ptr] = data
        dev.buffers[ptr] = extra.buffers[ptr]
        dev.original[ptr] = extra.original[ptr]
    sleep(dev, pool, ("weights",))
    adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)
    assert dev.intact("weights")
    assert pool.stats.grown == 1  # the freed slice was reused


def test_without_cuda_the_patch_is_not_installed_and_vllm_keeps_its_own_sleep():
    from engine_patches.settings import PatchSettings

    before = cumem.CuMemAllocator.sleep
    assert adapter.install(PatchSettings(sleep_pool=True), PinnedAllocator(registrar=RecordingRegistrar())) == []
    assert cumem.CuMemAllocator.sleep is before


def test_place_keeps_slices_apart_and_inside_one_chunk():
    spots, extra = place([100, 5000, 300], [8192], [[(0, 4096)]], chunk_bytes=8192)
    assert spots[0] is None or spots[0].offset >= 4096
    assert extra > 0
    with pytest.raises(ValueError, match="larger than one registration chunk"):
        place([9000], [], [], chunk_bytes=8192)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40_000), min_size=1, max_size=30),
    caps=st.lists(st.integers(0, 120_000), max_size=3),
    chunk_pages=st.integers(10, 20),
    seed=st.integers(0, 1000),
)
def test_place_never_overlaps_never_crosses_a_chunk_and_sizes_the_new_region_exactly(sizes, caps, chunk_pages, seed):
    chunk = chunk_pages * 4096
    rng = random.Random(seed)
    held = [[(0, rng.randrange(0, cap // 2 + 1))] if cap else [] for cap in caps]
    spots, extra = place(sizes, caps, held, chunk)
    regions = list(caps)
    if extra:
        regions.append(extra)
        spots, again = place(sizes, regions, held + [[]], chunk)
        assert again == 0
    used: dict[int, list[tuple[int, int]]] = {r: [(o, o + n) for o, n in h if n] for r, h in enumerate(held)}
    for n, s in zip(sizes, spots, strict=True):
        assert s is not None and s.nbytes == n
        assert s.offset + n <= regions[s.region]
        assert s.offset // chunk == (s.offset + n - 1) // chunk
        for a, b in used.setdefault(s.region, []):
            assert s.offset >= b or s.offset + n <= a
        used[s.region].append((s.offset, s.offset + n))


def test_a_pool_prepared_after_the_weights_load_makes_the_first_sleep_take_no_memory():
    dev = FakeDevice({"weights": [3 * MIB, 2 * MIB], "kv_cache": [4 * MIB]})
    pool, _, _ = make_pool()
    adapter.prepare_in_background(dev.allocator, pool).join()
    assert pool.stats.pool_bytes >= 5 * MIB and pool.stats.grown == 1
    pinned = pool.allocator.stats().pinned_bytes
    sleep(dev, pool, ("weights",))
    assert pool.stats.grown == 1 and pool.allocator.stats().pinned_bytes == pinned
    adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)
    assert dev.intact("weights")
    pool.prepare(5 * MIB)  # already there: nothing more is taken
    assert pool.stats.grown == 1


def test_a_copy_that_fails_while_it_runs_also_leaves_the_engine_awake_and_whole():
    dev = FakeDevice({"weights": [2 * MIB], "kv_cache": [2 * MIB]})
    pool, mover, _ = make_pool()
    mover.fail_on_wait = True
    with pytest.raises(RuntimeError, match="asynchronous copy failed"):
        sleep(dev, pool, ("weights",))
    assert dev.unmapped == []  # not even the KV cache
    assert not any(d.is_asleep or d.cpu_backup_tensor is not None for d in dev.allocator.pointer_to_data.values())


def test_a_wake_that_fails_half_way_settles_what_it_restored_and_leaves_the_rest_asleep():
    dev = FakeDevice({"weights": [2 * MIB, 2 * MIB, 2 * MIB]})
    pool, mover, _ = make_pool()
    sleep(dev, pool, ("weights",))
    calls = {"n": 0}

    def map_until_out_of_memory(handle):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")
        dev.buffers[handle[2]].fill_(0x11)

    dev.ops.create_and_map = map_until_out_of_memory
    waits = mover.waits
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)
    assert mover.waits == waits + 1  # the two queued copies were waited for
    datas = list(dev.allocator.pointer_to_data.items())
    for ptr, data in datas[:2]:
        assert not data.is_asleep and data.cpu_backup_tensor is None
        assert torch.equal(dev.buffers[ptr], dev.original[ptr])
    assert datas[2][1].is_asleep and datas[2][1].cpu_backup_tensor is not None
    assert pool.stats.slept_bytes == 2 * MIB  # only the one still asleep holds its slice
    dev.ops.create_and_map = dev._map
    adapter.pooled_wake_up(dev.allocator, None, pool, dev.ops)  # a later wake finishes the job
    assert dev.intact("weights")


def test_graph_capture_waits_for_a_prepare_still_running():
    import threading

    release = threading.Event()
    done = []

    class SlowPool:
        def prepare(self, nbytes):
            release.wait(5)
            done.append(nbytes)

    dev = FakeDevice({"weights": [1 * MIB]})
    adapter.prepare_in_background(dev.allocator, SlowPool())
    threading.Timer(0.2, release.set).start()
    adapter.wait_for_prepare()
    assert done == [1 * MIB]


def test_the_pool_says_why_memory_could_not_be_pinned():
    alloc = PinnedAllocator(registrar=RecordingRegistrar(fail_after=0))
    tensor, why = alloc.allocate_pinned(1 * MIB)
    assert tensor is None and "cudaHostRegister refused" in (why or "")
    assert alloc.stats().mapped_bytes == 0  # nothing kept pageable
