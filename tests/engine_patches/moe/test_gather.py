import pytest
import torch

from engine_patches.moe.gather import copy_experts


def _check(src, dst, method):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, dst.shape[0] + 1, (1,), generator=g))
        experts = torch.randperm(src.shape[0], generator=g)[:n].tolist()
        slots = torch.randperm(dst.shape[0], generator=g)[:n].tolist()
        dst.fill_(float("nan"))
        moved = copy_experts(src, dst, experts, slots, method)
        if dst.is_cuda:
            torch.cuda.synchronize()
        for e, s in zip(experts, slots, strict=False):
            assert torch.equal(dst[s].cpu(), src[e].cpu())
        assert moved == n * src[0].numel() * src.element_size()


def test_memcpy_copies_any_experts_into_any_slots():
    _check(torch.randn(12, 6, 10), torch.empty(7, 6, 10), "memcpy")


def test_consecutive_runs_are_copied_correctly():
    src, dst = torch.randn(10, 4), torch.zeros(10, 4)
    copy_experts(src, dst, [2, 3, 4, 7], [5, 6, 7, 0])
    assert torch.equal(dst[5:8], src[2:5]) and torch.equal(dst[0], src[7])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton gather runs on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gather_matches_for_any_ids(dtype):
    src = torch.randn(12, 6, 10).to(dtype).pin_memory()
    _check(src, torch.empty(7, 6, 10, dtype=dtype, device="cuda"), "triton")


def _check_pairs(device, use_triton, programs=0):
    from engine_patches.moe.gather import copy_expert_pairs_indexed

    g = torch.Generator().manual_seed(1)
    src = (torch.randn(12, 6, 8, generator=g), torch.randn(12, 10, generator=g))
    if device == "cuda":
        src = tuple(t.pin_memory() for t in src)
    for _ in range(10):
        n = int(torch.randint(1, 7, (1,), generator=g))
        experts = torch.randperm(12, generator=g)[:n].int()
        slots = torch.randperm(7, generator=g)[:n].int()
        experts[torch.rand(n, generator=g) < 0.3] = -1  # skipped pairs, anywhere in the list
        dst = (torch.full((7, 6, 8), float("nan"), device=device), torch.full((7, 10), float("nan"), device=device))
        copy_expert_pairs_indexed(
            src, dst, experts.to(device), slots.to(device), use_triton=use_triton, programs=programs, block=16
        )
        for e, s in zip(experts.tolist(), slots.tolist(), strict=False):
            if e >= 0:
                assert torch.equal(dst[0][s].cpu(), src[0][e]) and torch.equal(dst[1][s].cpu(), src[1][e])
        copied = {s for e, s in zip(experts.tolist(), slots.tolist(), strict=False) if e >= 0}
        untouched = [s for s in range(7) if s not in copied]
        assert torch.isnan(dst[0][untouched]).all() and torch.isnan(dst[1][untouched]).all()


def test_pair_gather_copies_both_tensors_and_skips_padding_on_cpu():
    _check_pairs("cpu", use_triton=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton gather runs on a GPU")
@pytest.mark.parametrize("programs", [0, 1, 5])
def test_pair_gather_matches_for_any_ids_and_grid_sizes(programs):
    _check_pairs("cuda", use_triton=True, programs=programs)
