"""The exact-size allocator, with a recording stand-in for cudaHostRegister (no GPU here)."""

import gc

import pytest
import torch

from engine_patches.pinned import PAGE, PinnedAllocator


class RecordingRegistrar:
    def __init__(self, fail_after: int | None = None):
        self.live: dict[int, int] = {}
        self.calls = 0
        self.fail_after = fail_after

    def available(self) -> bool:
        return True

    def register(self, ptr: int, nbytes: int) -> int:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            return 2  # cudaErrorMemoryAllocation
        assert ptr % PAGE == 0 and nbytes % PAGE == 0, "chunks must not share pages"
        self.live[ptr] = nbytes
        return 0

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]


def test_pin_copies_exactly_and_registers_the_page_rounded_size():
    reg = RecordingRegistrar()
    alloc = PinnedAllocator(registrar=reg)
    src = torch.arange(1000, dtype=torch.bfloat16).reshape(10, 100)
    out = alloc.pin(src)
    assert torch.equal(out, src) and out.dtype == src.dtype and out.shape == src.shape
    s = alloc.stats()
    assert s.asked_bytes == 2000
    assert s.pinned_bytes == PAGE and sum(reg.live.values()) == PAGE  # not 2048, not 4096*k
    assert s.pageable_fallbacks == 0


def test_large_allocations_are_registered_in_chunks():
    reg = RecordingRegistrar()
    alloc = PinnedAllocator(registrar=reg, chunk_bytes=1 << 20)
    t = alloc.empty((5 << 20,), torch.uint8)
    assert len(reg.live) == 5 and alloc.stats().chunks == 5
    assert sum(reg.live.values()) == 5 << 20
    del t


def test_memory_is_unregistered_when_the_last_view_goes():
    reg = RecordingRegistrar()
    alloc = PinnedAllocator(registrar=reg)
    t = alloc.empty((4, 1024), torch.float32)
    view = t[1:3].t()  # vLLM keeps views around (transposes, slices)
    del t
    gc.collect()
    assert reg.live, "still in use through the view"
    del view
    gc.collect()
    assert reg.live == {}
    s = alloc.stats()
    assert s.pinned_bytes == 0 and s.allocations == 0 and s.peak_pinned_bytes == 4 * 4096


def test_over_budget_falls_back_to_pageable_and_counts_it(caplog):
    reg = RecordingRegistrar()
    alloc = PinnedAllocator(registrar=reg, budget_bytes=3 * PAGE)
    a = alloc.empty((2 * PAGE,), torch.uint8)
    b = alloc.empty((2 * PAGE,), torch.uint8)
    c = alloc.empty((2 * PAGE,), torch.uint8)
    s = alloc.stats()
    assert s.pinned_bytes == 2 * PAGE and s.pageable_bytes == 4 * PAGE
    assert s.over_budget == 2 and s.pageable_fallbacks == 2
    assert caplog.text.count("pin budget") == 1  # logged once, counted every time
    b.fill_(7)
    assert int(b.sum()) == 7 * 2 * PAGE  # pageable memory still works
    del a, b, c


def test_a_refused_registration_undoes_its_chunks_and_stays_pageable():
    reg = RecordingRegistrar(fail_after=2)
    alloc = PinnedAllocator(registrar=reg, chunk_bytes=PAGE)
    t = alloc.empty((4 * PAGE,), torch.uint8)
    assert reg.live == {}  # the two chunks that succeeded were unregistered again
    s = alloc.stats()
    assert s.register_failures == 1 and s.pageable_bytes == 4 * PAGE and s.pinned_bytes == 0
    t.fill_(1)


def test_without_cuda_everything_works_unpinned():
    alloc = PinnedAllocator()  # the real CUDA registrar; this machine has no GPU
    if alloc.pinning_available():
        pytest.skip("a GPU is present")
    t = alloc.pin(torch.ones(3, 3))
    assert torch.equal(t, torch.ones(3, 3))
    s = alloc.stats()
    assert s.pageable_bytes == PAGE and s.pageable_fallbacks == 0  # expected, not a fallback


def test_stats_callback_sees_every_change():
    seen = []
    alloc = PinnedAllocator(registrar=RecordingRegistrar(), on_change=seen.append)
    t = alloc.empty((10,), torch.float32)
    del t
    gc.collect()
    assert [s.allocations for s in seen] == [1, 0]


def test_repeated_allocations_do_not_grow_rss():
    from bench.lora_shapes import malloc_trim, rss_bytes

    alloc = PinnedAllocator(registrar=RecordingRegistrar())
    malloc_trim()
    for _ in range(3):
        held = [alloc.empty((1 << 20,), torch.uint8).fill_(1) for _ in range(32)]  # 32 MiB
        del held
    gc.collect()
    before = rss_bytes()
    for _ in range(20):
        held = [alloc.empty((1 << 20,), torch.uint8).fill_(1) for _ in range(32)]
        del held
        gc.collect()
    assert rss_bytes() - before < 8 << 20  # unmapped on free, nothing cached
