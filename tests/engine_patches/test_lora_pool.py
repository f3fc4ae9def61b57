import gc

import pytest
import torch

from engine_patches.lora_pool import AdapterTooLargeError, CPULoRAPool, PoolFullError
from engine_patches.pinned import PinnedAllocator
from tests.engine_patches.test_pinned import RecordingRegistrar

BF16 = torch.bfloat16
A = ((4, 64), BF16)  # 512 B
B = ((64, 4), BF16)  # 512 B
ADAPTER_BYTES = 2 * 1024  # two modules of A + B


def modules():
    return {"q_proj": (A, B), "v_proj": (A, B)}


def fill_with(value):
    def fill(name, a, b):
        a.fill_(value)
        b.fill_(value)

    return fill


@pytest.fixture
def registrar():
    return RecordingRegistrar()


def make_pool(registrar, capacity, **kw):
    return CPULoRAPool(capacity, allocator=PinnedAllocator(registrar=registrar), **kw)


def test_allocate_deallocate_reuses_the_same_slot(registrar):
    pool = make_pool(registrar, 1 << 20)
    t = pool.allocate((4, 64), BF16)
    ptr = t.data_ptr()
    pool.deallocate(t)
    assert pool.allocate((4, 64), BF16).data_ptr() == ptr
    assert pool.stats().slabs == 1 and len(registrar.live) == 1  # one slab, pinned once


def test_shapes_are_grouped_into_separate_slabs(registrar):
    pool = make_pool(registrar, 1 << 20)
    pool.allocate((4, 64), BF16)
    pool.allocate((64, 4), BF16)
    pool.allocate((4, 64), torch.float32)
    assert pool.stats().slabs == 3


def test_deallocating_a_foreign_tensor_is_an_error(registrar):
    pool = make_pool(registrar, 1 << 20)
    with pytest.raises(ValueError, match="not allocated by this pool"):
        pool.deallocate(torch.zeros(4, 64, dtype=BF16))


def test_loaded_adapter_holds_its_data_and_counts_hits(registrar):
    pool = make_pool(registrar, 1 << 20)
    adapter = pool.load("a", modules(), fill_with(3.0))
    assert float(adapter.layers["q_proj"].lora_b.sum()) == 3.0 * 256
    assert pool.get("a") is adapter and pool.get("zzz") is None
    s = pool.stats()
    assert (s.hits, s.misses, s.adapters_resident, s.used_bytes) == (1, 1, 1, ADAPTER_BYTES)


def test_full_pool_evicts_the_least_recently_used_unpinned_adapter(registrar):
    pool = make_pool(registrar, 2 * ADAPTER_BYTES, slab_bytes=512)  # room for two adapters
    pool.load("a", modules(), fill_with(1.0))
    pool.load("b", modules(), fill_with(2.0))
    pool.get("a")  # a is now more recent than b
    c = pool.load("c", modules(), fill_with(5.0))
    assert pool.resident() == ["a", "c"]
    assert pool.stats().evictions == 1
    assert float(c.layers["v_proj"].lora_a.sum()) == 5.0 * 256  # b's slots reused, refilled
    assert pool.stats().reserved_bytes <= 2 * ADAPTER_BYTES


def test_pinned_adapters_are_never_evicted(registrar):
    pool = make_pool(registrar, 2 * ADAPTER_BYTES, slab_bytes=512)
    pool.load("a", modules(), fill_with(1.0), pinned=True)
    pool.load("b", modules(), fill_with(2.0))
    pool.load("c", modules(), fill_with(3.0))
    assert pool.resident() == ["a", "c"]
    pool.pin("c")
    with pytest.raises(PoolFullError, match="every resident adapter is pinned"):
        pool.load("d", modules(), fill_with(4.0))
    assert pool.resident() == ["a", "c"]  # the failed load gave its slots back
    assert pool.stats().used_bytes == 2 * ADAPTER_BYTES


def test_an_adapter_that_can_never_fit_gets_a_clear_error(registrar):
    pool = make_pool(registrar, ADAPTER_BYTES - 1)
    with pytest.raises(AdapterTooLargeError, match="raise lora_pool_bytes"):
        pool.load("big", modules(), fill_with(1.0))
    assert pool.stats().slabs == 0


def test_removing_gives_slots_back_and_del_is_a_safety_net(registrar):
    pool = make_pool(registrar, 1 << 20)
    pool.load("a", modules(), fill_with(1.0))
    assert pool.remove("a") and not pool.remove("a")
    assert pool.stats().used_bytes == 0
    from engine_patches.lora_pool import PooledLoRALayerWeights

    layer = PooledLoRALayerWeights("x", pool.allocate(*A), pool.allocate(*B), pool)
    del layer
    gc.collect()
    assert pool.stats().used_bytes == 0


def test_idle_slabs_of_one_shape_make_room_for_another(registrar):
    pool = make_pool(registrar, 1024, slab_bytes=1024)
    t = pool.allocate((4, 64), BF16)  # a 2048-byte slab of 4 slots
    pool.deallocate(t)
    pool.allocate((8, 64), BF16)  # needs a new slab: the idle one is dropped
    assert pool.stats().slabs == 1


def test_many_load_unload_cycles_do_not_grow_rss():
    from bench.lora_shapes import malloc_trim, rss_bytes

    pool = CPULoRAPool(64 << 20, allocator=PinnedAllocator(registrar=RecordingRegistrar()))
    big = {f"m{i}": (((16, 2048), BF16), ((2048, 16), BF16)) for i in range(32)}  # 4 MiB

    def cycles(start, stop):
        for i in range(start, stop):
            pool.load(i % 20, big, fill_with(float(i % 3)))  # 20 ids > 16 that fit: evictions
            if i % 7 == 0:
                pool.remove((i - 1) % 20)

    cycles(0, 60)  # the pool reaches its working size (slabs are taken once)
    malloc_trim()
    before = rss_bytes()
    cycles(60, 300)
    malloc_trim()
    assert pool.stats().evictions > 0
    assert rss_bytes() - before < 4 << 20
    assert pool.stats().reserved_bytes <= 64 << 20
