"""One token's experts computed while the missing ones are read from host memory (decode, batch 1).

The gather-then-compute path runs three things one after another per layer: the copy of the missing
experts, then the matrix-vector products of all eight. Here the gate/up kernel does both at once:
a program whose entry's expert is being loaded reads its rows of w13 straight from pinned host
memory (in place, over the link), uses them, and writes them into the expert's cache slot on the
way; it also copies its share of the expert's w2 into the slot. Programs of resident experts read
the slot as before and finish long before the link does, so their math costs no time at all.
The down projection then reads every w2 from the slots.

For one token only: each missing expert then belongs to exactly one (token, k) entry, so exactly
one entry writes each loading slot and no entry reads a slot that is still being written.
"""

from __future__ import annotations

import torch

from .experts_triton import GATE_UP_BLOCK_H, HAVE_TRITON, MAX_ENTRIES

# Launch shape of the gate/up kernel (bench/moe_layer_parts.py times the choices): intermediate
# rows and hidden columns per program and step, warps, and whether a loading expert's w2 is copied
# by programs of its own (W2_CHUNK elements each) or shared out over the gate/up programs.
BLOCK_ROWS = 16
BLOCK_H = GATE_UP_BLOCK_H
NUM_WARPS = 4
SPLIT_W2 = False
W2_CHUNK = 16384

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .experts_triton import down_and_sum

    @triton.jit
    def _copy_chunk(src, dst, first, n, CHUNK, BC: tl.constexpr):
        for c0 in range(0, CHUNK, BC):
            offs = first + c0 + tl.arange(0, BC)
            m = (offs < n) & (offs < first + CHUNK)
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    @triton.jit
    def _gate_up_fetch_kernel(
        x,
        w13,
        host_w13,
        w2,
        host_w2,
        expert_ids,
        slot_ids,
        load_slot_ids,
        act,
        H,
        I,
        PARTS,
        W2_CHUNK,
        BI: tl.constexpr,
        BH: tl.constexpr,
        BC: tl.constexpr,
        SPLIT_W2: tl.constexpr,
    ):
        # Programs (entry, part): part < PARTS computes BI intermediate rows of the entry's
        # gate/up; with SPLIT_W2 the parts past PARTS each copy one W2_CHUNK of a loading
        # expert's w2, else every gate/up program of a loading entry copies its own share.
        entry = tl.program_id(0)
        part = tl.program_id(1)
        slot = tl.load(slot_ids + entry).to(tl.int64)
        expert = tl.maximum(tl.load(expert_ids + entry).to(tl.int64), 0)
        # load_slot_ids >= 0: this entry's expert is being loaded into that (same) slot now.
        fetch = tl.load(load_slot_ids + entry) >= 0
        n2 = H * I
        w2_src = host_w2 + expert * n2
        if part < PARTS:
            i_r = part * BI + tl.arange(0, BI)
            i_lim = tl.where(slot >= 0, I, 0)  # a skipped entry (slot -1) loads nothing: zeros
            h_lim = tl.where(slot >= 0, H, 0)
            slot = tl.maximum(slot, 0)
            i_ok = i_r < i_lim
            gate = tl.zeros((BI,), dtype=tl.float32)
            up = tl.zeros((BI,), dtype=tl.float32)
            dst = w13 + slot * (2 * I) * H
            if fetch:
                src = host_w13 + expert * (2 * I) * H
            else:
                src = dst
            for h0 in range(0, H, BH):
                h_r = h0 + tl.arange(0, BH)
                h_ok = h_r < h_lim
                xv = tl.load(x + h_r, mask=h_ok, other=0.0).to(tl.float32)
                m = i_ok[:, None] & h_ok[None, :]
                g_off = i_r[:, None] * H + h_r[None, :]
                u_off = (i_r[:, None] + I) * H + h_r[None, :]
                wg = tl.load(src + g_off, mask=m, other=0.0)
                wu = tl.load(src + u_off, mask=m, other=0.0)
                if fetch:  # leave the rows in the cache slot for the next tokens
                    tl.store(dst + g_off, wg, mask=m)
                    tl.store(dst + u_off, wu, mask=m)
                gate += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
                up += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
            a = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(act + entry * I + i_r, a, mask=i_r < I)
            if not SPLIT_W2 and fetch:
                _copy_chunk(w2_src, w2 + slot * n2, part.to(tl.int64) * W2_CHUNK, n2, W2_CHUNK, BC)
        else:
            if fetch:
                _copy_chunk(
                    w2_src, w2 + tl.maximum(slot, 0) * n2, (part - PARTS).to(tl.int64) * W2_CHUNK, n2, W2_CHUNK, BC
                )


def fetches_in_kernel(x: torch.Tensor, entries: int) -> bool:
    """Whether ``fetch_and_compute`` can run this batch: CUDA + Triton, one token, few entries."""
    return x.is_cuda and HAVE_TRITON and x.shape[0] == 1 and entries <= MAX_ENTRIES


def fetch_and_compute(
    x: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
    host: tuple[torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    slot_ids: torch.Tensor,
    load_slot_ids: torch.Tensor,
) -> torch.Tensor:
    """The MoE output of one token whose missing experts are loaded by the same kernels.

    ``slots``: the layer's cache (w13 [S, 2I, H], w2 [S, H, I]) on the GPU; ``host``: its store
    (w13 [E, 2I, H], w2 [E, H, I]) in pinned host memory (or any memory the GPU can read);
    ``topk_ids`` [1, k] expert ids; ``slot_ids`` [1, k] their slots (-1: skip the entry);
    ``load_slot_ids`` [1, k] the slot where the entry's expert is being loaded, -1 where it is
    resident (the device planner's ``miss_slot_ids``). Afterwards every loaded slot holds its
    expert, as the gather would have left it.
    """
    if x.shape[0] != 1:
        raise ValueError(f"fetch_and_compute runs one token, got {x.shape[0]}: use the gather path")
    if not HAVE_TRITON:
        raise RuntimeError("fetch_and_compute needs Triton installed")
    (w13, w2), (host_w13, host_w2) = slots, host
    for name, t in (("slot w13", w13), ("slot w2", w2), ("host w13", host_w13), ("host w2", host_w2)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if host_w13.shape[1:] != w13.shape[1:] or host_w2.shape[1:] != w2.shape[1:]:
        raise ValueError("host and slot expert shapes differ")
    for t in (host_w13, host_w2):
        if t.device.type == "cpu" and w13.is_cuda and not t.is_pinned():
            raise ValueError("the kernel reads host memory in place: the store must be pinned")
    entries = slot_ids.numel()
    hidden, inter = x.shape[1], w2.shape[-1]
    parts = triton.cdiv(inter, BLOCK_ROWS)
    bc = 4096
    if SPLIT_W2:  # w2 in chunks of its own programs
        chunk = W2_CHUNK
        grid = (entries, parts + triton.cdiv(hidden * inter, chunk))
    else:  # w2 shared out over the gate/up programs
        chunk = triton.cdiv(triton.cdiv(hidden * inter, parts), bc) * bc
        grid = (entries, parts)
    ids = topk_ids.reshape(-1).contiguous()
    sids = slot_ids.reshape(-1).contiguous()
    act = torch.empty(entries, inter, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    _gate_up_fetch_kernel[grid](
        x,
        w13,
        host_w13,
        w2,
        host_w2,
        ids,
        sids,
        load_slot_ids.reshape(-1).contiguous(),
        act,
        hidden,
        inter,
        parts,
        chunk,
        BI=BLOCK_ROWS,
        BH=BLOCK_H,
        BC=min(bc, chunk),
        SPLIT_W2=SPLIT_W2,
        num_warps=NUM_WARPS,
    )
    return down_and_sum(act, w2, slot_ids, topk_weights, x.dtype)
