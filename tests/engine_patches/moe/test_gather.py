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
        for e, s in zip(experts, slots):
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
