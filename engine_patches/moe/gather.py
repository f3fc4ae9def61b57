"""Copy chosen experts from host memory into GPU cache slots: dst[slots[i]] = src[experts[i]].

Two ways, same result for any ids:
- ``memcpy``: one async copy per run of consecutive (expert, slot) pairs; plain torch, runs
  everywhere (on CPU it is an ordinary copy). The DMA engines reach the full pinned bandwidth.
- ``triton``: one gather kernel in which GPU threads read pinned host memory in place (UVA), so a
  whole batch of experts costs one launch. Needs CUDA, Triton and a pinned ``src``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

CopyMethod = Literal["memcpy", "triton"]

try:  # Triton is optional: the CPU build and a machine without it use the torch path.
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_rows_kernel(src, dst, src_rows, dst_rows, row_elems, BLOCK: tl.constexpr):
        pair = tl.program_id(0)
        chunk = tl.program_id(1)
        s_row = tl.load(src_rows + pair).to(tl.int64)
        d_row = tl.load(dst_rows + pair).to(tl.int64)
        # -1: a padding entry of the device planner's list, nothing to copy.
        limit = tl.where(s_row >= 0, row_elems, 0)
        s_row = tl.maximum(s_row, 0)
        d_row = tl.maximum(d_row, 0)
        offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < limit
        vals = tl.load(src + s_row * row_elems + offs, mask=mask)
        tl.store(dst + d_row * row_elems + offs, vals, mask=mask)

    @triton.jit
    def _gather_pairs_kernel(
        src_a, dst_a, src_b, dst_b, experts, slots, P, words_a, words_b, BLOCK: tl.constexpr, BP: tl.constexpr
    ):
        # Both weight tensors of every listed expert in one launch, so the link never idles
        # between a w13 launch and a w2 launch. The grid may be smaller than the work: each
        # program strides over the (expert, tensor, chunk) units, which leaves SMs free for the
        # expert math that runs beside the copy. Only valid (>= 0) pairs make units, wherever
        # the padding sits, so the loop does no empty turns at batch 1.
        p_r = tl.arange(0, BP)
        e_all = tl.load(experts + p_r, mask=p_r < P, other=-1).to(tl.int64)
        s_all = tl.load(slots + p_r, mask=p_r < P, other=-1).to(tl.int64)
        valid = e_all >= 0
        rank = tl.cumsum(valid.to(tl.int32), 0) - 1  # position among the valid pairs
        chunks_a = tl.cdiv(words_a, BLOCK)
        per_pair = chunks_a + tl.cdiv(words_b, BLOCK)
        total = tl.sum(valid.to(tl.int32), axis=0) * per_pair
        for u in range(tl.program_id(0), total, tl.num_programs(0)):
            pair = u // per_pair
            c = u % per_pair
            pick = valid & (rank == pair)
            e = tl.sum(tl.where(pick, e_all, 0), axis=0)
            s = tl.sum(tl.where(pick, s_all, 0), axis=0)
            if c < chunks_a:
                offs = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                m = offs < words_a
                vals = tl.load(src_a + e * words_a + offs, mask=m)
                tl.store(dst_a + s * words_a + offs, vals, mask=m)
            else:
                offs = (c - chunks_a).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                m = offs < words_b
                vals = tl.load(src_b + e * words_b + offs, mask=m)
                tl.store(dst_b + s * words_b + offs, vals, mask=m)

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def _runs(experts: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge pairs whose expert and slot both step by one: (first expert, first slot, length)."""
    runs: list[tuple[int, int, int]] = []
    for e, s in sorted(zip(experts, slots, strict=False)):
        if runs and runs[-1][0] + runs[-1][2] == e and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((e, s, 1))
    return runs


def copy_rows_memcpy(src: torch.Tensor, dst: torch.Tensor, experts: Sequence[int], slots: Sequence[int]) -> None:
    for e, s, n in _runs(experts, slots):
        dst[s : s + n].copy_(src[e : e + n], non_blocking=True)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous [R, ...] tensor as [R, words] of the widest integer that divides a row."""
    flat = t.view(t.shape[0], -1)
    row_bytes = flat.shape[1] * t.element_size()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0:
            return flat.view(dtype)
    return flat.view(torch.uint8)


def copy_rows_triton(
    src: torch.Tensor, dst: torch.Tensor, experts: Sequence[int], slots: Sequence[int], block: int = 4096
) -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the triton copy method needs Triton installed; use copy_method='memcpy'")
    if not (src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:]):
        raise ValueError("triton expert copy needs contiguous src/dst of the same dtype and row shape")
    if src.device.type == "cpu" and not src.is_pinned():
        raise ValueError("triton expert copy reads host memory in place: src must be pinned")
    if not experts:
        return
    s_words, d_words = _as_words(src), _as_words(dst)
    idx = torch.tensor([list(experts), list(slots)], dtype=torch.int64, pin_memory=True)
    idx = idx.to(dst.device, non_blocking=True)
    row = s_words.shape[1]
    grid = (len(experts), triton.cdiv(row, block))
    _gather_rows_kernel[grid](s_words, d_words, idx[0], idx[1], row, BLOCK=block)


def copy_experts_indexed(
    src: torch.Tensor,
    dst: torch.Tensor,
    experts: torch.Tensor,
    slots: torch.Tensor,
    *,
    use_triton: bool | None = None,
    block: int = 4096,
    num_warps: int = 4,
) -> None:
    """``dst[slots[i]] = src[experts[i]]`` where the ids are tensors on the device; -1 skips.

    The device slot planner's copies: which experts to fetch is known only on the GPU, so on
    CUDA this is the Triton gather reading pinned host memory in place (one launch, no host read,
    CUDA-graph safe). The torch path (boolean indexing) is for the CPU.
    """
    if use_triton is None:
        use_triton = dst.is_cuda
    if not use_triton:
        keep = experts >= 0
        dst[slots[keep].long()] = src[experts[keep].long().to(src.device)].to(dst.device)
        return
    if not HAVE_TRITON:
        raise RuntimeError("copying experts chosen on the GPU needs Triton installed")
    if not (src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:]):
        raise ValueError("expert gather needs contiguous src/dst of the same dtype and row shape")
    if src.device.type == "cpu" and dst.is_cuda and not src.is_pinned():
        raise ValueError("the expert gather reads host memory in place: src must be pinned")
    s_words, d_words = _as_words(src), _as_words(dst)
    row = s_words.shape[1]
    grid = (experts.shape[0], triton.cdiv(row, block))
    _gather_rows_kernel[grid](s_words, d_words, experts, slots, row, BLOCK=block, num_warps=num_warps)


def copy_expert_pairs_indexed(
    src: tuple[torch.Tensor, torch.Tensor],
    dst: tuple[torch.Tensor, torch.Tensor],
    experts: torch.Tensor,
    slots: torch.Tensor,
    *,
    use_triton: bool | None = None,
    programs: int = 0,
    block: int = 4096,
    num_warps: int = 4,
) -> None:
    """``dst[j][slots[i]] = src[j][experts[i]]`` for both weight tensors (w13, w2); -1 skips.

    The same copy as two ``copy_experts_indexed`` calls, in one Triton launch on CUDA.
    ``programs``: how many programs share the work (0: one per chunk, the widest grid); fewer
    programs leave SMs to kernels running beside the copy. Both tensors are read in 8-byte words
    where their rows allow (bf16 expert rows always do).
    """
    if use_triton is None:
        use_triton = dst[0].is_cuda
    if not use_triton:
        for s_t, d_t in zip(src, dst, strict=False):
            copy_experts_indexed(s_t, d_t, experts, slots, use_triton=False)
        return
    if not HAVE_TRITON:
        raise RuntimeError("copying experts chosen on the GPU needs Triton installed")
    words = []
    for s_t, d_t in zip(src, dst, strict=False):
        if not (
            s_t.is_contiguous() and d_t.is_contiguous() and s_t.dtype == d_t.dtype and s_t.shape[1:] == d_t.shape[1:]
        ):
            raise ValueError("expert gather needs contiguous src/dst of the same dtype and row shape")
        if s_t.device.type == "cpu" and d_t.is_cuda and not s_t.is_pinned():
            raise ValueError("the expert gather reads host memory in place: src must be pinned")
        words.append((_as_words(s_t), _as_words(d_t)))
    (sa, da), (sb, db) = words
    n = experts.shape[0]
    units = n * (triton.cdiv(sa.shape[1], block) + triton.cdiv(sb.shape[1], block))
    grid = (max(1, min(programs, units)) if programs > 0 else max(1, units),)
    _gather_pairs_kernel[grid](
        sa,
        da,
        sb,
        db,
        experts,
        slots,
        n,
        sa.shape[1],
        sb.shape[1],
        BLOCK=block,
        BP=max(2, 1 << (n - 1).bit_length()),
        num_warps=num_warps,
    )


def copy_experts(
    src: torch.Tensor, dst: torch.Tensor, experts: Sequence[int], slots: Sequence[int], method: CopyMethod = "memcpy"
) -> int:
    """Copy ``src[experts[i]]`` into ``dst[slots[i]]`` on the current stream; returns bytes moved."""
    if len(experts) != len(slots):
        raise ValueError(f"{len(experts)} experts but {len(slots)} slots")
    if method == "triton" and dst.is_cuda:
        copy_rows_triton(src, dst, experts, slots)
    elif method in ("memcpy", "triton"):
        copy_rows_memcpy(src, dst, experts, slots)
    else:
        raise ValueError(f"copy method must be 'memcpy' or 'triton', got {method!r}")
    return len(experts) * src[0].numel() * src.element_size()
