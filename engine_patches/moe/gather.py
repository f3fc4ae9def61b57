"""Copy chosen experts from host memory into GPU cache slots: dst[slots[i]] = src[experts[i]].

Two ways, same result for any ids:
- ``memcpy``: one async copy per run of consecutive (expert, slot) pairs; plain torch, runs
  everywhere (on CPU it is an ordinary copy). The DMA engines reach the full pinned bandwidth.
- ``triton``: one gather kernel in which GPU threads read pinned host memory in place (UVA), so a
  whole batch of experts costs one launch. Needs CUDA, Triton and a pinned ``src``.
"""

from __future__ import annotations

from typing import Literal, Sequence

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
        offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_elems
        vals = tl.load(src + s_row * row_elems + offs, mask=mask)
        tl.store(dst + d_row * row_elems + offs, vals, mask=mask)

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def _runs(experts: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge pairs whose expert and slot both step by one: (first expert, first slot, length)."""
    runs: list[tuple[int, int, int]] = []
    for e, s in sorted(zip(experts, slots)):
        if runs and runs[-1][0] + runs[-1][2] == e and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((e, s, 1))
    return runs


def copy_rows_memcpy(src: torch.Tensor, dst: torch.Tensor, experts: Sequence[int],
                     slots: Sequence[int]) -> None:
    for e, s, n in _runs(experts, slots):
        dst[s:s + n].copy_(src[e:e + n], non_blocking=True)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous [R, ...] tensor as [R, words] of the widest integer that divides a row."""
    flat = t.view(t.shape[0], -1)
    row_bytes = flat.shape[1] * t.element_size()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0:
            return flat.view(dtype)
    return flat.view(torch.uint8)


def copy_rows_triton(src: torch.Tensor, dst: torch.Tensor, experts: Sequence[int],
                     slots: Sequence[int], block: int = 4096) -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the triton copy method needs Triton installed; use copy_method='memcpy'")
    if not (src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
            and src.shape[1:] == dst.shape[1:]):
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


def copy_experts(src: torch.Tensor, dst: torch.Tensor, experts: Sequence[int],
                 slots: Sequence[int], method: CopyMethod = "memcpy") -> int:
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
