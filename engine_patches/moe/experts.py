"""The expert math the runtime feeds with cache slots, and the plain reference it is checked against.

Convention (vLLM's): w13 [E, 2I, H] holds gate then up; act = silu(x @ gate^T) * (x @ up^T);
y = act @ w2^T with w2 [E, H, I]; the layer output is sum_k topk_weight * y_k.
An ``ExpertsFn(x, w13, w2, topk_weights, slot_ids)`` gets ids in slot space where -1 means
"skip this (token, k) entry": the runtime uses that to compute resident experts while others load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .experts_triton import HAVE_TRITON, MAX_ENTRIES, gemv_experts, gemv_experts_split

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def reference_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Token by token, in float64: slow and obviously right."""
    x64, w13_64, w2_64 = x.double(), w13.double(), w2.double()
    inter = w2.shape[-1]
    out = torch.zeros_like(x64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            h = w13_64[e] @ x64[t]
            act = F.silu(h[:inter]) * h[inter:]
            out[t] += float(topk_weights[t, k]) * (w2_64[e] @ act)
    return out.to(x.dtype)


def looped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """One pass per used slot; reads the ids on the host. Portable (the CPU path)."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    flat_ids = slot_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).to(x.dtype)
    k = slot_ids.shape[1]
    for s in torch.unique(flat_ids).tolist():
        if s < 0:
            continue
        pairs = (flat_ids == s).nonzero().squeeze(1)
        tok = pairs // k
        h = x[tok] @ w13[s].t()
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[s].t()
        out.index_add_(0, tok, y * flat_w[pairs, None])
    return out


def grouped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """Two grouped matmuls over (token, k) pairs sorted by slot; no host sync (GPU path)."""
    num_slots, inter = w13.shape[0], w2.shape[-1]
    k = slot_ids.shape[1]
    flat = slot_ids.reshape(-1).long()
    key = torch.where(flat < 0, num_slots, flat)  # skipped pairs sort last, past every group
    order = torch.argsort(key, stable=True)
    # scatter_add, not bincount: bincount on CUDA reads the max id back to the host (a sync).
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_slots]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tok = order // k
    xs = x[tok]
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    w = topk_weights.reshape(-1)[order].to(y.dtype)
    # Rows past the last group are never written by grouped_mm: mask them, do not multiply by 0.
    y = torch.where((key[order] < num_slots)[:, None], y * w[:, None], 0.0)
    out = torch.zeros_like(x)
    out.index_add_(0, tok, y)
    return out


def auto_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """On CUDA: Triton matrix-vector kernels for decode-sized batches (few (token, k) entries),
    grouped_mm above that (bf16, rows a multiple of 16 bytes); the loop elsewhere."""
    if x.is_cuda and HAVE_TRITON and slot_ids.numel() <= MAX_ENTRIES:
        return gemv_experts(x, w13, w2, topk_weights, slot_ids)
    aligned = all(d * x.element_size() % 16 == 0 for d in (x.shape[-1], w2.shape[-1]))
    if x.is_cuda and x.dtype == torch.bfloat16 and aligned and hasattr(torch, "_grouped_mm"):
        return grouped_experts(x, w13, w2, topk_weights, slot_ids)
    return looped_experts(x, w13, w2, topk_weights, slot_ids)


def split_experts(
    fn: ExpertsFn,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    first_ids: torch.Tensor,
    second_ids: torch.Tensor,
    between: Callable[[], None],
) -> torch.Tensor:
    """``fn`` over ``first_ids``, then ``between()``, then over ``second_ids``, summed.

    The runtime's way to compute a layer's resident experts while its missing ones load. With
    ``auto_experts`` at decode sizes this is the matrix-vector kernels in two passes sharing one
    output (two launches more than one pass); otherwise two calls of ``fn`` and an add.
    """
    if fn is auto_experts and x.is_cuda and HAVE_TRITON and first_ids.numel() <= MAX_ENTRIES:
        return gemv_experts_split(x, w13, w2, topk_weights, first_ids, second_ids, between)
    y = fn(x, w13, w2, topk_weights, first_ids)
    between()
    return y + fn(x, w13, w2, topk_weights, second_ids)


def splits_cheaply(fn: ExpertsFn, x: torch.Tensor, slot_ids: torch.Tensor) -> bool:
    """Whether ``split_experts`` costs only a couple of launches (not a second grouped pass)."""
    return not x.is_cuda or (fn is auto_experts and HAVE_TRITON and slot_ids.numel() <= MAX_ENTRIES)
