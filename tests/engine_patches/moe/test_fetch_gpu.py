"""The fetch path on a real GPU: one token, experts read from pinned host memory by the kernels.

Skipped without CUDA (CI has none); the same kernels run under Triton's interpreter in
test_device_slots.py. Run on a GPU box with ``pytest --noconftest tests/engine_patches/moe``.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _offload(store, **kw):
    from engine_patches.moe.offload import ExpertOffload

    return ExpertOffload(store, device="cuda", slots_per_layer=10, planner="device", **kw)


def _store(layers=3, experts=24, hidden=640, inter=192):
    from engine_patches.moe.store import ExpertStore

    g = torch.Generator().manual_seed(3)
    store = ExpertStore(allocator=lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True))
    for _ in range(layers):
        store.add_layer(
            (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).bfloat16(),
            (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).bfloat16(),
        )
    return store


def _steps(n, layers, experts, k=8, seed=5):
    g = torch.Generator().manual_seed(seed)
    hot = torch.randperm(experts, generator=g)[:12]
    out = []
    for step in range(n):
        pool = hot if step % 3 else torch.arange(experts)  # reuse, with some cold steps
        out.append([pool[torch.randperm(len(pool), generator=g)[:k]].view(1, k) for _ in range(layers)])
    return out


def test_fetch_path_equals_the_gather_path_and_the_reference():
    from engine_patches.moe.experts import reference_moe

    store = _store()
    fetch, gather = _offload(store), _offload(store, fetch_in_kernel=False)
    g = torch.Generator().manual_seed(9)
    for ids in _steps(12, len(store.layers), store.layers[0].num_experts):
        for layer, lid in enumerate(ids):
            x = torch.randn(1, 640, generator=g).bfloat16().cuda()
            w = torch.softmax(torch.randn(1, 8, generator=g), -1).cuda()
            lid = lid.cuda()
            a = fetch.forward(layer, x, w, lid)
            b = gather.forward(layer, x, w, lid)
            assert torch.equal(a, b)  # same kernels and summation order: the same bits
            ref = reference_moe(
                x.cpu().float(), store.layers[layer].w13.float(), store.layers[layer].w2.float(), w.cpu(), lid.cpu()
            )
            assert float((a.cpu().float() - ref).norm() / ref.norm()) < 2e-2
    sf, sg = fetch.stats(), gather.stats()
    assert (sf.hits, sf.misses, sf.bytes_moved) == (sg.hits, sg.misses, sg.bytes_moved)
    assert sf.misses > 0 and sf.hits > 0  # the steps above both reuse and evict


def test_fetch_path_runs_inside_a_cuda_graph():
    store = _store(layers=2)
    eager, graphed = _offload(store), _offload(store)
    steps = _steps(8, 2, store.layers[0].num_experts, seed=6)
    x = torch.randn(1, 640).bfloat16().cuda()
    w = torch.softmax(torch.randn(1, 8), -1).cuda()
    ids_buf = [s.cuda() for s in steps[0]]

    def step(off, ids):
        return sum(off.forward(layer, x, w, lid) for layer, lid in enumerate(ids))

    step(graphed, ids_buf)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(graphed, ids_buf)
    step(eager, ids_buf)  # both caches have now seen steps[0] once
    for ids in steps[1:]:
        for buf, new in zip(ids_buf, ids, strict=False):
            buf.copy_(new)
        graph.replay()
        want = step(eager, ids_buf)
        assert torch.equal(out, want)
    # Replays run no Python: their counters reach the host copy that the stats thread reads.
    torch.cuda.synchronize()
    beside, synced, ref = graphed.stats(sync=False), graphed.stats(), eager.stats()
    assert (beside.hits, beside.misses, beside.tokens) == (synced.hits, synced.misses, synced.tokens)
    assert (synced.hits, synced.misses, synced.tokens) == (ref.hits, ref.misses, ref.tokens) and ref.tokens == 8


def test_experts_fetched_ahead_on_the_side_stream_inside_a_cuda_graph():
    """Layer 0 fetches layer 1's guessed experts on the side stream; layer 1 waits for them. The
    fork and the join are both in the one graph (as in vLLM's full graphs), and replays give what
    the same steps give with no fetching ahead."""
    store = _store(layers=2)
    ahead, plain = _offload(store), _offload(store)
    steps = _steps(8, 2, store.layers[0].num_experts, seed=7)
    x = torch.randn(1, 640).bfloat16().cuda()
    w = torch.softmax(torch.randn(1, 8), -1).cuda()
    ids_buf = [s.cuda() for s in steps[0]]
    guess_buf = ids_buf[1].clone()  # a right guess at layer 1, with its last expert wrong below

    def step(off, ids, guess):
        y = off.forward(0, x, w, ids[0], guess_next=(lambda _x: guess) if guess is not None else None)
        return y + off.forward(1, x, w, ids[1])

    step(ahead, ids_buf, guess_buf)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(ahead, ids_buf, guess_buf)
    step(plain, ids_buf, None)
    for ids in steps[1:]:
        for buf, new in zip(ids_buf, ids, strict=False):
            buf.copy_(new)
        guess_buf.copy_(ids[1])
        guess_buf[0, -1] = (int(ids[1][0, -1]) + 1) % store.layers[0].num_experts
        graph.replay()
        want = step(plain, ids_buf, None)
        assert torch.equal(out, want)
    torch.cuda.synchronize()
    s = ahead.stats()
    assert s.ahead_experts > 0 and s.ahead_used > 0
    assert s.misses < plain.stats().misses  # layer 1 found most of its experts fetched ahead


@pytest.mark.parametrize("policy", ["lru", "frequency"])
def test_the_planner_kernel_plans_what_the_torch_planner_plans_on_the_gpu(policy):
    """The Triton planner on the GPU (its lookups through a scratch row written and read across
    barriers, which the interpreter runs one after another) against the torch planner: the same
    plans and the same tables, at the Qwen3-30B-A3B shape with batches of up to 64 tokens."""
    from engine_patches.moe.device_slots import DeviceSlotTables

    experts, slots, top_k, layers = 128, 32, 8, 2
    kernel = DeviceSlotTables(layers, experts, slots, "cuda", use_triton=True, policy=policy)
    torch_ = DeviceSlotTables(layers, experts, slots, "cuda", use_triton=False, policy=policy)
    g = torch.Generator().manual_seed(11)
    hot = torch.randperm(experts, generator=g)[:40]
    for step in range(200):
        tokens = int(torch.randint(1, 65, (1,), generator=g))
        pool = hot if step % 3 else torch.arange(experts)
        ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(tokens)])
        if step % 7 == 3:
            ids[0, -1] = -1
        ids = ids.cuda()
        layer, ahead = step % layers, step % 5 == 2
        a = kernel.plan(layer, ids, overflow=True, ahead=ahead)
        b = torch_.plan(layer, ids, overflow=True, ahead=ahead)
        for name in ("slot_ids", "hit_slot_ids", "miss_slot_ids", "overflow_ids", "load_experts", "load_slots"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (name, step)
        for name in ("expert_slot", "slot_expert", "last_used", "clock", "counts", "ahead"):
            assert torch.equal(getattr(kernel, name), getattr(torch_, name)), (name, step)
        assert torch.allclose(kernel.freq, torch_.freq, rtol=1e-5, atol=1e-6), step
