"""Helper for test_device_slots.py: the Triton kernels, run by Triton's CPU interpreter.

Run as ``TRITON_INTERPRET=1 python triton_interpret_check.py``: the slot planner kernel must leave
exactly the state and plan the torch planner leaves, and the gather kernel must copy exactly the
experts the plan lists. Prints ``OK <n>`` (plans compared), ``SKIP <why>`` when this Triton's
interpreter cannot run such kernels at all, or fails with an assertion.
"""

import sys

import numpy
import torch
import triton
import triton.language as tl

from engine_patches.moe import fetch_experts
from engine_patches.moe.device_slots import CachePolicy, DeviceSlotTables
from engine_patches.moe.experts import reference_moe
from engine_patches.moe.experts_triton import gemv_experts, gemv_experts_split
from engine_patches.moe.fetch_experts import fetch_and_compute
from engine_patches.moe.gather import copy_expert_pairs_indexed, copy_experts_indexed


@triton.jit
def _loop_probe(out, n):
    acc = 0
    for i in range(0, n):
        acc += i
    tl.store(out, acc)


def interpreter_cannot_run_these_kernels() -> str | None:
    """Why this Triton interpreter cannot run loops bounded by a kernel argument, or None.

    Every kernel here has such a loop. Triton 3.6's interpreter turns the bound into a Python
    int with ``int()`` of a one-element array, which numpy 2.4 refuses (the device machine's
    image); newer Triton or older numpy run it."""
    out = torch.zeros(1, dtype=torch.int32)
    try:
        _loop_probe[(1,)](out, 4)
    except Exception as exc:
        return (
            f"Triton {triton.__version__}'s interpreter cannot run a loop with a runtime "
            f"bound under numpy {numpy.__version__}: {exc!r}"[:300]
        )
    assert int(out) == 6, "the interpreter ran the probe loop wrongly"
    return None


def main() -> None:
    why = interpreter_cannot_run_these_kernels()
    if why is not None:
        print(f"SKIP {why}")
        return
    g = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    compared = 0
    # The last shape is Qwen3-30B-A3B's at a 25 % cache, with batches of up to 64 tokens: the most the
    # engine plans on the GPU by default (engine_patches.moe.sizing.IN_PLACE_TOKENS).
    for experts, slots, top_k, most in ((16, 4, 4, 0), (16, 9, 2, 0), (12, 12, 3, 0), (40, 24, 8, 0), (128, 32, 8, 64)):
        layers = 2
        policy: CachePolicy = "frequency" if experts in (16, 128) else "lru"  # both rules, on shapes of each
        kernel = DeviceSlotTables(layers, experts, slots, "cpu", use_triton=True, policy=policy)
        torch_ = DeviceSlotTables(layers, experts, slots, "cpu", use_triton=False, policy=policy)
        # The warm-up at engine start plans on a scratch table: the plans below must match the torch
        # planner's, which had none.
        sizes = kernel.warm_up(most or slots // top_k, top_k, ahead=not most)
        assert sizes and max(sizes) == (most or slots // top_k), sizes
        hot = torch.randperm(experts, generator=g)[: max(top_k, experts // 3)]
        src = torch.randn(experts, 3, 5, generator=g)
        for step in range(12 if most else 30):  # the interpreter is slow on the big shape
            # Up to three tokens more than fit at once: those plans read experts in place.
            tokens = int(torch.randint(1, (most or slots // top_k + 3) + 1, (1,), generator=g))
            pool = hot if step % 3 else torch.arange(experts)  # skewed, with reuse
            ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(tokens)])
            if step % 7 == 3:
                ids[0, -1] = -1  # a skipped entry
            layer = step % layers
            ahead = step % 4 == 1  # a guess at the layer's next batch: loaded ahead, judged next time
            a = kernel.plan(layer, ids, overflow=True, ahead=ahead)
            b = torch_.plan(layer, ids, overflow=True, ahead=ahead)
            for name in ("slot_ids", "hit_slot_ids", "miss_slot_ids", "overflow_ids", "load_experts", "load_slots"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (name, step)
            for name in ("expert_slot", "slot_expert", "last_used", "clock", "counts", "ahead", "freq"):
                assert torch.equal(getattr(kernel, name), getattr(torch_, name)), (name, step)
            dst_k, dst_t = torch.full((slots, 3, 5), float("nan")), torch.zeros(slots, 3, 5)
            dst_k.copy_(dst_t)
            copy_experts_indexed(src, dst_k, a.load_experts, a.load_slots, use_triton=True, block=8)
            copy_experts_indexed(src, dst_t, a.load_experts, a.load_slots, use_triton=False)
            assert torch.equal(dst_k, dst_t), step
            # Both weight tensors in one launch, with a grid wider and narrower than the work;
            # the second tensor's rows have another size (and so another word count).
            src_b = torch.randn(experts, 7, generator=g)
            for programs in (0, 1, 3):
                got_pair = (torch.zeros(slots, 3, 5), torch.zeros(slots, 7))
                want = (torch.zeros(slots, 3, 5), torch.zeros(slots, 7))
                copy_expert_pairs_indexed(
                    (src, src_b), got_pair, a.load_experts, a.load_slots, use_triton=True, programs=programs, block=4
                )
                copy_expert_pairs_indexed((src, src_b), want, a.load_experts, a.load_slots, use_triton=False)
                assert torch.equal(got_pair[0], want[0]) and torch.equal(got_pair[1], want[1]), step
            compared += 1
    # The decode-batch expert kernels against the float64 reference, skipped entries included.
    for tokens, k, slots, hidden, inter in ((1, 4, 6, 40, 24), (3, 2, 5, 64, 36)):
        w13 = torch.randn(slots, 2 * inter, hidden, generator=g) / hidden**0.5
        w2 = torch.randn(slots, hidden, inter, generator=g) / inter**0.5
        x = torch.randn(tokens, hidden, generator=g)
        ids = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(tokens)])
        ids[-1, 0] = -1
        w = torch.rand(tokens, k, generator=g)
        got, ref = gemv_experts(x, w13, w2, w, ids), reference_moe(x, w13, w2, w, ids)
        assert float((got - ref).norm() / ref.norm()) < 1e-5, (tokens, k)
        # Split in two passes (resident entries, then loaded ones): the same sum.
        second = torch.where(torch.rand(ids.shape, generator=g) < 0.5, ids, -1)
        first = torch.where(second >= 0, -1, ids)
        calls = []
        two_passes = gemv_experts_split(x, w13, w2, w, first, second, lambda: calls.append(1))
        assert calls == [1] and float((two_passes - ref).norm() / ref.norm()) < 1e-5, (tokens, k)
        compared += 1
    # One token with its missing experts read from the store inside the expert kernels: the
    # output equals the reference over the store's experts, and afterwards every loaded slot
    # holds its expert. The store handed to the kernel has its already-resident experts scaled,
    # so an entry that read the store instead of its slot would change the output.
    # Both launch shapes: w2 shared out over the gate/up programs, and w2 in programs of its own
    # (small chunks, so an expert's w2 spans several).
    # Hidden 600 > the kernel's 512-column step, so its column loop turns twice, and w2 is
    # shared out over 3 gate/up programs; bf16 checks the in-kernel casts.
    fetch_experts.W2_CHUNK = 256
    f32, bf16 = torch.float32, torch.bfloat16
    for split, k, experts, slots, hidden, inter, dtype in (
        (False, 4, 10, 6, 40, 24, f32),
        (False, 3, 7, 3, 64, 36, f32),
        (False, 3, 7, 4, 600, 40, f32),
        (True, 4, 10, 6, 40, 24, f32),
        (True, 3, 7, 3, 64, 36, f32),
        (True, 2, 5, 3, 600, 40, bf16),
    ):
        fetch_experts.SPLIT_W2 = split
        tol = 1e-5 if dtype == f32 else 2e-2
        host = (
            (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype),
            (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype),
        )
        tables = DeviceSlotTables(1, experts, slots, "cpu", use_triton=False)
        cache = (
            torch.full((slots, 2 * inter, hidden), float("nan"), dtype=dtype),
            torch.full((slots, hidden, inter), float("nan"), dtype=dtype),
        )
        x = torch.randn(1, hidden, generator=g).to(dtype)
        for step in range(4):
            ids = torch.randperm(experts, generator=g)[:k].view(1, k)
            if step == 2:
                ids[0, 1] = -1  # a skipped entry
            w = torch.rand(1, k, generator=g)
            plan = tables.plan(0, ids)
            before = (cache[0].clone(), cache[1].clone())
            resident = [e for e in ids[0].tolist() if e >= 0 and e not in plan.load_experts.tolist()]
            seen = (host[0].clone(), host[1].clone())
            for e in resident:
                seen[0][e] *= 1.5
                seen[1][e] *= 1.5
            got = fetch_and_compute(x, cache, seen, w, ids, plan.slot_ids, plan.miss_slot_ids)
            ref = reference_moe(x, host[0], host[1], w, ids)
            assert got.dtype == dtype, got.dtype
            assert float((got.float() - ref.float()).norm() / ref.float().norm()) < tol, (k, step)
            for e, s in zip(plan.load_experts.tolist(), plan.load_slots.tolist(), strict=False):
                if e >= 0:
                    assert torch.equal(cache[0][s], host[0][e]) and torch.equal(cache[1][s], host[1][e])
            loaded = {s for s in plan.load_slots.tolist() if s >= 0}
            for s in set(range(slots)) - loaded:  # nothing else was written
                assert torch.equal(cache[0][s].nan_to_num(7.0), before[0][s].nan_to_num(7.0))
                assert torch.equal(cache[1][s].nan_to_num(7.0), before[1][s].nan_to_num(7.0))
            compared += 1
    print(f"OK {compared}")


if __name__ == "__main__":
    main()
