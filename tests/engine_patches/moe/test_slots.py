import pytest

from engine_patches.moe.slots import ExpertSlotTable


def test_first_use_loads_then_hits():
    t = ExpertSlotTable(num_experts=8, num_slots=3)
    plan = t.assign([5, 1])
    assert plan.hits == [] and sorted(e for e, _ in plan.loads) == [1, 5]
    plan = t.assign([1, 5])
    assert sorted(plan.hits) == [1, 5] and plan.loads == []


def test_evicts_least_recently_used_and_reuses_its_slot():
    t = ExpertSlotTable(num_experts=8, num_slots=3)
    t.assign([0, 1, 2])
    t.assign([0])  # 1 is now the oldest
    slot_of_1 = t.resident()[1]
    plan = t.assign([7])
    assert plan.loads == [(7, slot_of_1)]
    assert set(t.resident()) == {0, 2, 7}


def test_needed_experts_never_evict_each_other():
    t = ExpertSlotTable(num_experts=16, num_slots=4)
    t.assign([0, 1, 2, 3])
    plan = t.assign([3, 9, 10, 0])
    assert sorted(plan.hits) == [0, 3]
    assert set(t.resident()) == {0, 3, 9, 10}
    assert len(set(plan.slot_of.values())) == 4


def test_refuses_more_experts_than_slots_and_bad_ids():
    t = ExpertSlotTable(num_experts=8, num_slots=2)
    with pytest.raises(ValueError, match="slots"):
        t.assign([0, 1, 2])
    with pytest.raises(ValueError, match="out of range"):
        t.assign([8])
    with pytest.raises(ValueError, match="distinct"):
        t.assign([1, 1])
