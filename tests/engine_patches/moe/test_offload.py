"""The offloaded MoE computes exactly what a plain MoE computes, whatever the cache does."""

import pytest
import torch

from engine_patches.moe.experts import looped_experts, reference_moe
from engine_patches.moe.offload import ExpertOffload
from engine_patches.moe.store import ExpertStore

E, H, I, LAYERS, TOP_K = 16, 24, 20, 3, 4


@pytest.fixture
def model():
    g = torch.Generator().manual_seed(1234)
    weights = [
        (torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5)
        for _ in range(LAYERS)
    ]
    store = ExpertStore()
    for w13, w2 in weights:
        store.add_layer(w13, w2)
    return weights, store


def _routing(g, tokens):
    logits = torch.randn(tokens, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    return w, ids


def _run_many_batches(offload, weights, seed=7, steps=25):
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(steps):
        tokens = int(torch.randint(1, 9, (1,), generator=g))
        x = torch.randn(tokens, H, generator=g)
        for layer, (w13, w2) in enumerate(weights):
            w, ids = _routing(g, tokens)
            got = offload.forward(layer, x, w, ids)
            ref = reference_moe(x, w13, w2, w, ids)
            worst = max(worst, float((got - ref).norm() / ref.norm()))
            x = torch.tanh(got + x)  # feed forward like a real stack
    return worst


@pytest.mark.parametrize(
    "mode,slots,planner",
    [
        ("copy_all", None, "auto"),
        ("cached", 16, "auto"),
        ("cached", 6, "auto"),
        ("cached", 4, "auto"),
        ("cached", 6, "host"),
        ("cached", 16, "host"),
    ],
)
def test_matches_reference_moe(model, mode, slots, planner):
    """auto: batches of up to slots/top_k tokens plan on the device, larger ones on the host,
    handing the cache state over each time the batch size crosses that line."""
    weights, store = model
    offload = ExpertOffload(store, device="cpu", mode=mode, slots_per_layer=slots, planner=planner)
    assert _run_many_batches(offload, weights) < 1e-5


@pytest.mark.parametrize("device_overlap", [False, True])
def test_device_planner_alone_matches_reference_with_evictions(model, device_overlap):
    """device_overlap: resident experts in one pass, loaded ones in a second, summed."""
    weights, store = model
    offload = ExpertOffload(store, device="cpu", slots_per_layer=8, planner="device", device_overlap=device_overlap)
    g = torch.Generator().manual_seed(17)
    for _ in range(30):
        tokens = int(torch.randint(1, 3, (1,), generator=g))  # 2 x top-4 fits in 8 slots
        x = torch.randn(tokens, H, generator=g)
        for layer, (w13, w2) in enumerate(weights):
            assert offload.plans_on_device(_routing(g, tokens)[1])
            w, ids = _routing(g, tokens)
            got = offload.forward(layer, x, w, ids)
            ref = reference_moe(x, w13, w2, w, ids)
            assert float((got - ref).norm() / ref.norm()) < 1e-5
    s = offload.stats()
    assert s.misses > 8 * LAYERS  # the 8 slots of each layer were refilled: evictions happened
    assert s.hits > 0
    assert s.bytes_moved == s.misses * store.layers[0].expert_bytes
    assert s.tokens > 0


def test_small_cache_evicts_and_batches_larger_than_the_cache_run_in_rounds(model):
    weights, store = model
    offload = ExpertOffload(store, device="cpu", slots_per_layer=TOP_K)
    # 8 tokens x top-4 of 16 experts need far more than 4 slots: several rounds per layer.
    assert _run_many_batches(offload, weights, seed=3) < 1e-5
    s = offload.stats()
    assert s.misses > TOP_K * LAYERS  # experts were evicted and loaded again
    assert s.bytes_moved == s.misses * store.layers[0].expert_bytes


def test_cache_moves_fewer_bytes_than_copy_all_when_routing_repeats(model):
    weights, store = model
    g = torch.Generator().manual_seed(5)
    hot = torch.randperm(E, generator=g)[:6]  # skewed routing: a few popular experts
    cached = ExpertOffload(store, device="cpu", slots_per_layer=8)
    copy_all = ExpertOffload(store, device="cpu", mode="copy_all")
    for _ in range(10):
        x = torch.randn(1, H, generator=g)
        ids = hot[torch.randperm(6, generator=g)[:TOP_K]][None]
        w = torch.full((1, TOP_K), 1 / TOP_K)
        for layer in range(LAYERS):
            assert torch.allclose(cached.forward(layer, x, w, ids), copy_all.forward(layer, x, w, ids), atol=1e-6)
    c, a = cached.stats(), copy_all.stats()
    assert c.hit_rate > 0.5
    assert c.bytes_per_token * 4 < a.bytes_per_token
    assert c.gpu_cache_bytes < a.gpu_cache_bytes


def test_experts_fn_skips_entries_marked_minus_one(model):
    weights, _ = model
    w13, w2 = weights[0]
    x = torch.randn(3, H)
    ids = torch.tensor([[0, 1], [2, -1], [-1, -1]])
    w = torch.rand(3, 2)
    got = looped_experts(x, w13, w2, w, ids)
    assert torch.allclose(got, reference_moe(x, w13, w2, w, ids), atol=1e-5)
    assert torch.count_nonzero(got[2]) == 0


def test_empty_store_is_refused():
    with pytest.raises(ValueError, match="empty"):
        ExpertOffload(ExpertStore(), device="cpu")


def test_store_takes_memory_from_the_given_allocator(model):
    weights, _ = model
    calls = []

    def alloc(shape, dtype):
        calls.append(shape)
        return torch.empty(shape, dtype=dtype)

    store = ExpertStore(allocator=alloc)
    store.add_layer(*weights[0])
    assert calls == [(E, 2 * I, H), (E, H, I)]
    assert torch.equal(store.layers[0].w2, weights[0][1])
    assert store.host_bytes == (2 * I * H + H * I) * E * 4


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_experts_matches_reference_and_skips_minus_one(dtype, tol):
    """The sync-free GPU expert math (grouped matmuls) computes the same function."""
    from engine_patches.moe.experts import grouped_experts

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    g = torch.Generator().manual_seed(21)
    hid, inter = 32, 24  # grouped_mm wants rows that are a multiple of 16 bytes, as real models have
    w13 = torch.randn(E, 2 * inter, hid, generator=g) / hid**0.5
    w2 = torch.randn(E, hid, inter, generator=g) / inter**0.5
    for tokens in (1, 3, 9):
        x = torch.randn(tokens, hid, generator=g)
        w, ids = _routing(g, tokens)
        ids[0, -1] = -1
        got = grouped_experts(x.to(dtype), w13.to(dtype), w2.to(dtype), w, ids).float()
        ref = reference_moe(x, w13, w2, w, ids)
        assert float((got - ref).norm() / ref.norm()) < tol


def test_split_experts_sums_the_two_passes_and_waits_in_between(model):
    from engine_patches.moe.experts import split_experts

    weights, _ = model
    w13, w2 = weights[0]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, H, generator=g)
    w, ids = _routing(g, 3)
    second = torch.where(torch.rand(ids.shape, generator=g) < 0.4, ids, -1)
    first = torch.where(second >= 0, -1, ids)
    order = []

    def fn(*args):
        order.append("pass")
        return looped_experts(*args)

    got = split_experts(fn, x, w13, w2, w, first, second, lambda: order.append("wait"))
    assert order == ["pass", "wait", "pass"]
    assert torch.allclose(got, reference_moe(x, w13, w2, w, ids), atol=1e-5)


def test_host_path_rereads_device_tables_that_cuda_graph_replays_changed(model):
    """A CUDA-graph replay runs the device planner and the gather, but none of the runtime's
    Python: nothing marks the host table stale. Once a capture happened, the host path must
    reload the device tables every time, or it computes with experts that were evicted."""
    weights, store = model
    offload = ExpertOffload(store, device="cpu", slots_per_layer=8)
    offload._graph_captured = True  # what _forward_device sets while a graph is captured (CUDA only)
    g = torch.Generator().manual_seed(11)
    for _ in range(12):
        for tokens in (2, 2, 6):  # 2 x top-4 fits the 8 slots (device); 6 tokens do not (host)
            x = torch.randn(tokens, H, generator=g)
            for layer, (w13, w2) in enumerate(weights):
                w, ids = _routing(g, tokens)
                got = offload.forward(layer, x, w, ids)
                if tokens == 2:
                    offload._host_stale[layer] = False  # as after a replay: no Python ran
                ref = reference_moe(x, w13, w2, w, ids)
                assert float((got - ref).norm() / ref.norm()) < 1e-5


def test_a_batch_the_cache_cannot_hold_is_read_in_place_when_too_few_of_its_experts_are_resident(model):
    weights, store = model
    # 4 slots for 16 experts; 8 tokens x top-4 need about all 16, few of them resident.
    rounds = ExpertOffload(store, device="cpu", slots_per_layer=TOP_K, planner="host")
    streamed = ExpertOffload(
        store, device="cpu", slots_per_layer=TOP_K, planner="host", stream_view=lambda t: t, stream_below_hit_rate=0.5
    )
    assert _run_many_batches(rounds, weights, seed=3) < 1e-5
    assert _run_many_batches(streamed, weights, seed=3) < 1e-5  # the same answers
    by_rounds, in_place = rounds.stats(), streamed.stats()
    assert in_place.streamed_layers > 0 and by_rounds.streamed_layers == 0
    # Read in place, each layer's experts cross the link once and the cache is not churned.
    assert in_place.misses < by_rounds.misses
    assert in_place.streamed_bytes % store.layers[0].expert_bytes == 0
    assert in_place.bytes_per_token > 0


def test_a_batch_that_fits_in_the_cache_never_streams(model):
    weights, store = model
    offload = ExpertOffload(
        store, device="cpu", slots_per_layer=E, planner="host", stream_view=lambda t: t, stream_below_hit_rate=1.0
    )
    assert _run_many_batches(offload, weights) < 1e-5
    assert offload.stats().streamed_layers == 0


def test_streaming_is_off_by_default_and_its_share_is_checked(model):
    weights, store = model
    offload = ExpertOffload(store, device="cpu", slots_per_layer=TOP_K, planner="host", stream_view=lambda t: t)
    assert _run_many_batches(offload, weights, seed=3) < 1e-5
    assert offload.stats().streamed_layers == 0
    with pytest.raises(ValueError, match="stream_below_hit_rate"):
        ExpertOffload(store, device="cpu", slots_per_layer=TOP_K, stream_below_hit_rate=1.5)


@pytest.mark.parametrize("slots, policy", [(TOP_K, "lru"), (6, "lru"), (6, "frequency")])
def test_batches_past_the_cache_are_planned_on_the_device_with_the_rest_read_in_place(model, slots, policy):
    """Up to in_place_tokens tokens stay on the device planner (no host read, so inside a CUDA
    graph) however many experts they need: the missing ones fill the slots this batch does not
    use, the rest are read in place, and the answer is the plain MoE's, whichever expert the cache
    evicts."""
    weights, store = model
    offload = ExpertOffload(
        store, device="cpu", slots_per_layer=slots, stream_view=lambda t: t, in_place_tokens=8, cache_policy=policy
    )
    assert all(offload.plans_on_device(torch.zeros(t, TOP_K, dtype=torch.long)) for t in range(1, 9))
    assert not offload.plans_on_device(torch.zeros(9, TOP_K, dtype=torch.long))
    assert _run_many_batches(offload, weights, seed=3) < 1e-5  # 1 to 8 tokens a batch
    s = offload.stats()
    one = store.layers[0].expert_bytes
    assert s.streamed_bytes > 0 and s.streamed_bytes % one == 0  # experts read in place, counted
    assert s.bytes_moved + s.streamed_bytes == s.misses * one and s.hits > 0  # each miss crossed once
    assert not offload._tables[0].resident()  # the host table was never used


def test_without_a_view_of_host_memory_such_batches_go_to_the_host_table(model):
    weights, store = model
    offload = ExpertOffload(store, device="cpu", slots_per_layer=TOP_K, in_place_tokens=8)
    assert offload.in_place_tokens == 0 and not offload.plans_on_device(torch.zeros(2, TOP_K, dtype=torch.long))
    assert _run_many_batches(offload, weights, seed=3) < 1e-5
    assert offload.stats().streamed_bytes == 0
    with pytest.raises(ValueError, match="in_place_tokens"):
        ExpertOffload(store, device="cpu", stream_view=lambda t: t, in_place_tokens=-1)


def test_counters_reach_the_stats_file_without_a_step_that_runs_python(model, tmp_path):
    """Decode steps replayed from a CUDA graph run no Python: the publisher thread reads the
    counters beside the engine (no CUDA call, no wait) and puts them on the stats channel."""
    import time

    from engine_patches import stats as channel
    from engine_patches.moe.stats import Publisher

    weights, store = model
    offload = ExpertOffload(store, device="cpu", slots_per_layer=8, planner="device")
    channel.configure(tmp_path, interval_s=0.0)
    publisher = Publisher(lambda: offload.stats(sync=False), interval_s=0.05).start()
    try:
        _run_many_batches(offload, weights, steps=6)  # 1-8 tokens: planned on the device and on the host
        expected = offload.stats()
        assert expected.tokens > 0 and offload.stats(sync=False) == expected
        deadline = time.monotonic() + 10
        published: dict = {}
        while time.monotonic() < deadline:
            docs = channel.read_stats(tmp_path)
            published = docs[0].get("expert_cache", {}) if docs else {}
            if published.get("tokens") == expected.tokens:
                break
            time.sleep(0.05)
        assert published.get("tokens") == expected.tokens
        assert published["hits"] == expected.hits and published["misses"] == expected.misses
        assert publisher.tick() is False  # nothing changed since: nothing written again
    finally:
        publisher.stop()
        channel.configure(None)


def _run_with_guesses(offload, weights, guess, seed=11, steps=30):
    """Batches of 1-2 tokens through every layer; layer L guesses layer L+1's experts with
    ``guess(true_ids)`` (None: no guessing). Returns the worst relative error against the plain MoE."""
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(steps):
        tokens = int(torch.randint(1, 3, (1,), generator=g))
        x = torch.randn(tokens, H, generator=g)
        routes = [_routing(g, tokens) for _ in weights]
        for layer, (w13, w2) in enumerate(weights):
            w, ids = routes[layer]
            nxt = routes[layer + 1][1] if layer + 1 < len(routes) else None
            guess_next = None if nxt is None or guess is None else (lambda _x, nxt=nxt: guess(nxt))
            got = offload.forward(layer, x, w, ids, guess_next=guess_next)
            ref = reference_moe(x, w13, w2, w, ids)
            worst = max(worst, float((got - ref).norm() / ref.norm()))
            x = torch.tanh(got + x)
    return worst


def test_experts_fetched_ahead_on_a_right_guess_are_hits_and_the_output_is_unchanged(model):
    weights, store = model
    plain = ExpertOffload(store, device="cpu", slots_per_layer=8, planner="device")
    assert _run_with_guesses(plain, weights, None) < 1e-5  # the same routing, no guesses
    ahead = ExpertOffload(store, device="cpu", slots_per_layer=8, planner="device")
    assert _run_with_guesses(ahead, weights, lambda ids: ids) < 1e-5
    s, p = ahead.stats(), plain.stats()
    assert s.ahead_experts > 0 and s.ahead_used == s.ahead_experts and s.ahead_wasted == 0
    assert s.ahead_hit_rate == 1.0
    # Every layer after the first found its experts already fetched: only layer 0 missed.
    assert s.misses < p.misses and s.hit_rate > p.hit_rate
    assert s.bytes_moved == (s.misses + s.ahead_experts) * store.layers[0].expert_bytes
    assert s.ahead_bytes == s.ahead_experts * store.layers[0].expert_bytes


def test_a_wrong_guess_wastes_link_bytes_but_never_changes_the_output(model):
    weights, store = model
    offload = ExpertOffload(store, device="cpu", slots_per_layer=8, planner="device")
    # Always the same four experts: mostly not the ones the layer then needs.
    assert _run_with_guesses(offload, weights, lambda ids: torch.arange(TOP_K).expand_as(ids)) < 1e-5
    s = offload.stats()
    assert s.ahead_wasted > 0 and s.ahead_wasted_bytes == s.ahead_wasted * store.layers[0].expert_bytes
    assert 0.0 < s.ahead_hit_rate < 1.0


def test_the_host_planner_fetches_nothing_ahead(model):
    weights, store = model
    offload = ExpertOffload(store, device="cpu", slots_per_layer=8, planner="host")
    assert _run_with_guesses(offload, weights, lambda ids: ids) < 1e-5
    assert offload.stats().ahead_experts == 0


def test_the_eviction_rule_is_checked_and_is_lru_where_only_the_host_table_plans(model):
    _, store = model
    with pytest.raises(ValueError, match="cache_policy"):
        ExpertOffload(store, device="cpu", slots_per_layer=TOP_K, cache_policy="lfu")
    assert ExpertOffload(store, device="cpu", slots_per_layer=6, cache_policy="frequency").cache_policy == "frequency"
    host_only = ExpertOffload(store, device="cpu", slots_per_layer=6, planner="host", cache_policy="frequency")
    assert host_only.cache_policy == "lru"


def test_the_expert_kernel_warm_up_runs_each_batch_size_once_and_leaves_the_cache_as_it_was(model):
    """While the engine starts, vLLM's expert kernel runs once for every batch size it may get, so
    none compiles while a request waits; the cache, its counts and its slots' weights stay as they
    were, and the in-place pass reads no expert (every entry skipped)."""
    weights, store = model
    offload = ExpertOffload(store, device="cpu", slots_per_layer=6, stream_view=lambda t: t, in_place_tokens=8)
    _run_many_batches(offload, weights, steps=5)
    before = (offload.stats(), offload._device.export(0), [t.clone() for t in offload._slots[0]])
    seen: dict[str, list[int]] = {"slots": [], "in place": []}

    def recording(name):
        def fn(h, w13, w2, w, ids):
            seen[name].append(h.shape[0])
            assert h.shape[0] == w.shape[0] == ids.shape[0] and ids.shape[1] == TOP_K
            if name == "in place":
                assert bool((ids == -1).all())  # nothing crosses the link
                assert w13.shape[0] == E
            else:
                assert w13.shape[0] == 6 and int(ids.min()) >= 0 and int(ids.max()) < 6
            return looped_experts(h, w13, w2, w, ids)

        return fn

    x = torch.randn(3, H)
    w, _ = _routing(torch.Generator().manual_seed(5), 3)
    assert offload.warm_up_experts(x, w, recording("slots"), recording("in place"), most=40) == (40, 8)
    assert seen == {"slots": list(range(1, 41)), "in place": list(range(1, 9))}
    after = (offload.stats(), offload._device.export(0), offload._slots[0])
    assert after[0] == before[0] and after[1] == before[1]
    assert all(torch.equal(a, b) for a, b in zip(after[2], before[2], strict=True))
    assert _run_many_batches(offload, weights, seed=9, steps=5) < 1e-5
    copy_all = ExpertOffload(store, device="cpu", mode="copy_all")
    assert copy_all.warm_up_experts(x, w, recording("slots")) == (0, 0)


@pytest.mark.parametrize("slots, policy", [(TOP_K, "lru"), (6, "frequency")])
def test_experts_left_without_a_slot_can_be_staged_instead_of_read_in_place(model, slots, policy):
    """With stage_overflow, a batch past the cache gathers its experts left without a slot into a
    staging buffer (one layer's experts less the slots) and computes them there: the answers are the
    plain MoE's, nothing is read in place, and the buffer's bytes count as GPU memory kept."""
    weights, store = model

    def never(*args):
        raise AssertionError("an expert was read in place")

    offload = ExpertOffload(
        store,
        device="cpu",
        slots_per_layer=slots,
        stream_view=lambda t: t,
        in_place_tokens=8,
        cache_policy=policy,
        stage_overflow=True,
    )
    g = torch.Generator().manual_seed(21)
    worst, staged_batches = 0.0, 0
    for _ in range(20):
        tokens = int(torch.randint(1, 9, (1,), generator=g))
        x = torch.randn(tokens, H, generator=g)
        for layer, (w13, w2) in enumerate(weights):
            w, ids = _routing(g, tokens)
            staged_batches += int(ids.unique().numel() > slots)
            got = offload.forward(layer, x, w, ids, looped_experts, in_place_fn=never)
            ref = reference_moe(x, w13, w2, w, ids)
            worst = max(worst, float((got - ref).norm() / ref.norm()))
            x = torch.tanh(got + x)
    assert worst < 1e-5 and staged_batches > 10
    one = store.layers[0].expert_bytes
    assert offload.staging_bytes == (E - slots) * one
    assert offload.gpu_cache_bytes == (LAYERS * slots + E - slots) * one
    plain = ExpertOffload(store, device="cpu", slots_per_layer=slots, stream_view=lambda t: t, in_place_tokens=8)
    assert plain.staging_bytes == 0 and plain.gpu_cache_bytes == LAYERS * slots * one


def test_the_staging_plan_gives_each_left_out_expert_one_row_by_expert_id():
    from engine_patches.moe.offload import staging_plan

    overflow = torch.tensor([[9, -1, 3], [3, 12, -1]], dtype=torch.int32)
    rows, experts, at = staging_plan(overflow, 16)
    assert rows.tolist() == [[1, -1, 0], [0, 2, -1]]
    assert [(int(e), int(r)) for e, r in zip(experts, at, strict=True) if e >= 0] == [(3, 0), (9, 1), (12, 2)]
    assert experts.shape == (16,) and rows.dtype == overflow.dtype
