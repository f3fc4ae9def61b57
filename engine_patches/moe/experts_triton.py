"""Expert math for decode-sized batches: two Triton kernels, one pass over each used expert row.

At batch 1 the grouped-matmul path is a dozen small launches per layer (sort, counts, gathers,
two grouped matmuls, activation, weighting, scatter), and their fixed costs add up to more than
the weights' read time. Here every (token, k) entry is one matrix-vector product: kernel 1 computes
silu(gate) * up for a block of intermediate rows, kernel 2 the down projection times the routing
weight, summed over the token's k entries in the same kernel and written in the output dtype (the
two-pass split for overlapped copies keeps one row per entry and sums them afterwards). Entries
whose slot is -1 give zeros. Worth it while entries are few (each entry reads its expert's rows itself; the grouped path
reads an expert once for all of its tokens), so ``auto_experts`` picks it up to ``MAX_ENTRIES``.
"""

from __future__ import annotations

import torch

MAX_ENTRIES = 16  # (token, k) entries per layer: batch 2 at top-8
# Hidden columns per step of the gate/up kernels (this one and ``fetch_experts``): the same value
# in both keeps their sums in the same order, so fetched and resident experts give equal bits.
# 512 ran ~1 % faster than 256 where a layer fetches 2 of 8 experts (bench/README.md, run 6).
GATE_UP_BLOCK_H = 512

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _gate_up_kernel(
        x, w13, slot_ids, act, H, I, K, BI: tl.constexpr, BH: tl.constexpr, WRITE_SKIPPED: tl.constexpr
    ):
        entry = tl.program_id(0)
        i_r = tl.program_id(1) * BI + tl.arange(0, BI)
        slot = tl.load(slot_ids + entry).to(tl.int64)
        # WRITE_SKIPPED False: a skipped entry leaves its output alone (another pass owns it).
        if WRITE_SKIPPED:
            o_lim = I
        else:
            o_lim = tl.where(slot >= 0, I, 0)
        # A skipped entry (slot -1) masks every load: its outputs come out as zeros.
        i_lim = tl.where(slot >= 0, I, 0)
        h_lim = tl.where(slot >= 0, H, 0)
        slot = tl.maximum(slot, 0)
        tok = (entry // K).to(tl.int64)
        i_ok = i_r < i_lim
        gate = tl.zeros((BI,), dtype=tl.float32)
        up = tl.zeros((BI,), dtype=tl.float32)
        base = w13 + slot * (2 * I) * H
        for h0 in range(0, H, BH):
            h_r = h0 + tl.arange(0, BH)
            h_ok = h_r < h_lim
            xv = tl.load(x + tok * H + h_r, mask=h_ok, other=0.0).to(tl.float32)
            m = i_ok[:, None] & h_ok[None, :]
            wg = tl.load(base + i_r[:, None] * H + h_r[None, :], mask=m, other=0.0)
            wu = tl.load(base + (i_r[:, None] + I) * H + h_r[None, :], mask=m, other=0.0)
            gate += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
            up += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
        a = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act + entry * I + i_r, a, mask=i_r < o_lim)

    @triton.jit
    def _down_kernel(
        act, w2, slot_ids, weights, y, H, I, BO: tl.constexpr, BI: tl.constexpr, WRITE_SKIPPED: tl.constexpr
    ):
        entry = tl.program_id(0)
        o_r = tl.program_id(1) * BO + tl.arange(0, BO)
        slot = tl.load(slot_ids + entry).to(tl.int64)
        if WRITE_SKIPPED:
            y_lim = H
        else:
            y_lim = tl.where(slot >= 0, H, 0)
        o_lim = tl.where(slot >= 0, H, 0)
        i_lim = tl.where(slot >= 0, I, 0)
        slot = tl.maximum(slot, 0)
        o_ok = o_r < o_lim
        acc = tl.zeros((BO,), dtype=tl.float32)
        base = w2 + slot * H * I
        for i0 in range(0, I, BI):
            i_r = i0 + tl.arange(0, BI)
            i_ok = i_r < i_lim
            av = tl.load(act + entry * I + i_r, mask=i_ok, other=0.0)
            w = tl.load(base + o_r[:, None] * I + i_r[None, :], mask=o_ok[:, None] & i_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * av[None, :], axis=1)
        wt = tl.load(weights + entry).to(tl.float32)
        tl.store(y + entry * H + o_r, acc * wt, mask=o_r < y_lim)  # acc is 0 if skipped

    @triton.jit
    def _down_sum_kernel(
        act, w2, slot_ids, weights, out, H, I, K, BK: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr
    ):
        # One token's output rows o_r: the down projections of all its k entries at once (a
        # [BK, BO, BI] tile per step, so a program keeps k loads in flight), weighted, summed in
        # fp32 and written in the output's dtype: no per-entry buffer, sum or cast follows.
        tok = tl.program_id(0).to(tl.int64)
        o_r = tl.program_id(1) * BO + tl.arange(0, BO)
        k_r = tl.arange(0, BK)
        k_ok = k_r < K
        slot = tl.load(slot_ids + tok * K + k_r, mask=k_ok, other=-1).to(tl.int64)
        wt = tl.load(weights + tok * K + k_r, mask=k_ok, other=0.0).to(tl.float32)
        i_lim = tl.where(slot >= 0, I, 0)  # a skipped entry adds nothing
        base = tl.maximum(slot, 0) * H * I
        o_ok = o_r < H
        acc = tl.zeros((BK, BO), dtype=tl.float32)
        for i0 in range(0, I, BI):
            i_r = i0 + tl.arange(0, BI)
            i_ok = i_r[None, :] < i_lim[:, None]  # [BK, BI]
            av = tl.load(act + (tok * K + k_r[:, None]) * I + i_r[None, :], mask=i_ok, other=0.0)
            w = tl.load(
                w2 + base[:, None, None] + o_r[None, :, None] * I + i_r[None, None, :],
                mask=i_ok[:, None, :] & o_ok[None, :, None],
                other=0.0,
            )
            acc += tl.sum(w.to(tl.float32) * av[:, None, :], axis=2)
        y = tl.sum(acc * wt[:, None], axis=0)
        tl.store(out + tok * H + o_r, y.to(out.dtype.element_ty), mask=o_ok)

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def _gemv_pass(x, w13, w2, ids, wts, act, y, write_skipped: bool) -> None:
    entries, hidden, inter = ids.shape[0], x.shape[1], w2.shape[-1]
    k = entries // x.shape[0]
    bi, bh = 16, GATE_UP_BLOCK_H
    _gate_up_kernel[(entries, triton.cdiv(inter, bi))](
        x, w13, ids, act, hidden, inter, k, BI=bi, BH=bh, WRITE_SKIPPED=write_skipped, num_warps=4
    )
    bo, bk = 16, 256
    _down_kernel[(entries, triton.cdiv(hidden, bo))](
        act, w2, ids, wts, y, hidden, inter, BO=bo, BI=bk, WRITE_SKIPPED=write_skipped, num_warps=4
    )


def down_and_sum(
    act: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """sum_k weight * (w2[slot] @ act) per token, from ``act`` [T * k, I]; one launch."""
    tokens, k = slot_ids.shape
    hidden, inter = w2.shape[1], w2.shape[2]
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=act.device)
    bk = max(2, triton.next_power_of_2(k))
    bo = max(1, 32 // bk)  # a [bk, bo, 256] tile: 8192 weights per step
    _down_sum_kernel[(tokens, triton.cdiv(hidden, bo))](
        act,
        w2,
        slot_ids.reshape(-1).contiguous(),
        topk_weights.reshape(-1).contiguous(),
        out,
        hidden,
        inter,
        k,
        BK=bk,
        BO=bo,
        BI=256,
        num_warps=4,
    )
    return out


def gemv_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """The ``ExpertsFn`` contract with one matrix-vector product per (token, k) entry."""
    if not HAVE_TRITON:
        raise RuntimeError("gemv_experts needs Triton installed; use grouped_experts")
    tokens, k = slot_ids.shape
    inter = w2.shape[-1]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids = slot_ids.reshape(-1).contiguous()
    act = torch.empty(tokens * k, inter, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(tokens * k, triton.cdiv(inter, 16))](
        x, w13, ids, act, x.shape[1], inter, k, BI=16, BH=GATE_UP_BLOCK_H, WRITE_SKIPPED=True, num_warps=4
    )
    return down_and_sum(act, w2, slot_ids, topk_weights, x.dtype)


def gemv_experts_split(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    first_ids: torch.Tensor,
    second_ids: torch.Tensor | None,
    between,
) -> torch.Tensor:
    """The entries of ``first_ids``, then ``between()``, then those of ``second_ids``; one sum.

    For a cache whose missing experts are still loading: the resident ones (``first_ids``) are
    computed while the copy runs, ``between`` makes the stream wait for the copy, and only the
    loaded ones come after. An entry must be >= 0 in at most one of the two id tensors. Costs two
    launches more than one pass, not a second output buffer or sum.
    """
    if not HAVE_TRITON:
        raise RuntimeError("gemv_experts needs Triton installed; use grouped_experts")
    tokens, k = first_ids.shape
    hidden, inter = x.shape[1], w2.shape[-1]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    wts = topk_weights.reshape(-1).contiguous()
    act = torch.empty(tokens * k, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(tokens * k, hidden, dtype=torch.float32, device=x.device)
    _gemv_pass(x, w13, w2, first_ids.reshape(-1).contiguous(), wts, act, y, True)
    if between is not None:
        between()
    if second_ids is not None:
        _gemv_pass(x, w13, w2, second_ids.reshape(-1).contiguous(), wts, act, y, False)
    return y.view(tokens, k, hidden).sum(1).to(x.dtype)
