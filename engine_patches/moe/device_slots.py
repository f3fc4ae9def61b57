"""The slot tables on the device: which expert sits in which cache slot, decided without the host.

At decode batch sizes the host-side table costs more than the copies it plans: each layer has to
read the router's ids back to the host (a sync that drains the GPU queue) before it can launch
anything. Here the same LRU bookkeeping lives in small GPU tensors and one planning step per layer
(a Triton kernel on CUDA, the same algorithm in torch ops elsewhere) turns the top-k ids into
(a) the slot of every (token, k) entry and (b) a fixed-size list of (expert, slot) copies, padded
with -1, that the gather kernel reads. Nothing reads back to the host, so a decode step can be
captured in one CUDA graph.

Where a batch may need more experts than there are slots (tokens * top_k > slots), a plan made with
``overflow=True`` gives the missing experts the slots that hold no expert of this batch, in expert id
order, and lists the rest in ``overflow_ids``: the runtime's expert kernels read those in place from
host memory, so the step still needs no host read. Without it the runtime hands such batches to the
host table, passing the state over between the two (``export``/``load``).
LRU is per batch: the experts one batch uses share one clock tick, ties go to the lower slot.
With ``policy="frequency"`` the victim is instead the expert with the lowest use count, every count
decayed by ``FREQUENCY_DECAY`` at each of its layer's batches (ties by LRU): under the routing
stand-in it hits 81.9 % against LRU's 77.3 % at batch 1 and a quarter of the experts
(bench/moe_cache_policy.py). The host table, for batches planned on the host, stays LRU, and those
batches do not count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_patches.pinned import empty_pinned

from .sizing import CACHE_POLICIES, DEFAULT_CACHE_POLICY, CachePolicy, block, warm_up_tokens
from .store import is_pinned

try:  # Triton is optional: the torch path below computes the same plan.
    import triton
    import triton.language as tl

    # Compiled once per combination of its blocks (the constexprs): the sizes and the tables' row
    # addresses take no part in which variant runs, so planning one batch per block at start
    # (``DeviceSlotTables.warm_up``) leaves nothing to compile while requests wait.
    @triton.jit(
        do_not_specialize=["n", "decay", "E", "S", "P", "T"],
        do_not_specialize_on_alignment=[
            "ids_ptr",
            "expert_slot",
            "slot_expert",
            "last_used",
            "clock",
            "counts",
            "ahead",
            "freq",
            "mark",
            "slot_ids_out",
            "hit_ids_out",
            "miss_ids_out",
            "over_ids_out",
            "load_e_out",
            "load_s_out",
        ],
    )
    def _plan_kernel(
        ids_ptr,
        n,
        expert_slot,
        slot_expert,
        last_used,
        clock,
        counts,
        ahead,
        freq,
        decay,
        mark,
        slot_ids_out,
        hit_ids_out,
        miss_ids_out,
        over_ids_out,
        load_e_out,
        load_s_out,
        E,
        S,
        P,
        T,
        BN: tl.constexpr,
        BE: tl.constexpr,
        BS: tl.constexpr,
        BP: tl.constexpr,
        AHEAD: tl.constexpr,
        FREQ: tl.constexpr,
    ):
        # One program plans one layer. What is asked per entry or per slot of an expert is looked up in
        # ``mark`` (one int per expert, this layer's scratch row): written, then read after a barrier,
        # so the work grows with entries + experts. Only the victim order and the slot picks compare
        # all pairs ([BS, BS] and [BE, BS]: slots are few).
        n_r = tl.arange(0, BN)
        ids = tl.load(ids_ptr + n_r, mask=n_r < n, other=-2).to(tl.int32)
        # -1 (skip) and padding match no expert and no empty slot; nor does an id past the last
        # expert, which must not reach ``mark`` (the next layer's row lies there).
        valid = (ids >= 0) & (ids < E)
        ids = tl.where(valid, ids, -2)
        e_r = tl.arange(0, BE)
        e_ok = e_r < E
        tl.store(mark + e_r, 0, mask=e_ok)
        tl.debug_barrier()
        tl.store(mark + ids, 1 + 0 * ids, mask=valid)
        tl.debug_barrier()
        need = (tl.load(mark + e_r, mask=e_ok, other=0) > 0) & e_ok
        es = tl.load(expert_slot + e_r, mask=e_ok, other=-1)
        hit = need & (es >= 0)
        miss = need & (es < 0)
        s_r = tl.arange(0, BS)
        s_ok = s_r < S
        se = tl.load(slot_expert + s_r, mask=s_ok, other=-1)
        lu = tl.load(last_used + s_r, mask=s_ok, other=0)
        held = tl.load(mark + se, mask=s_ok & (se >= 0), other=0) > 0
        # Victim order: slots holding no needed expert first, oldest use first, lower slot first.
        cls = tl.where(s_ok, held.to(tl.int32), 2)
        cls_a, cls_b = cls[None, :], cls[:, None]
        lu_a, lu_b = lu[None, :], lu[:, None]
        older = (lu_a < lu_b) | ((lu_a == lu_b) & (s_r[None, :] < s_r[:, None]))
        if FREQ:  # the least used (decayed counts) first, then the oldest use; an empty slot first of all
            f = tl.load(freq + e_r, mask=e_ok, other=0.0)
            if not AHEAD:  # a guess is no use
                f = f * decay + need.to(tl.float32)
                tl.store(freq + e_r, f, mask=e_ok)
                tl.debug_barrier()
            key = tl.load(freq + se, mask=s_ok & (se >= 0), other=-1.0)
            key_a, key_b = key[None, :], key[:, None]
            older = (key_a < key_b) | ((key_a == key_b) & older)
        before = (cls_a < cls_b) | ((cls_a == cls_b) & older)
        rank = tl.sum(before.to(tl.int32), axis=1)  # [BS], a permutation of 0..BS-1
        miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1
        # Slots that hold no expert of this batch; missing experts past that many get no slot
        # (read in place from host memory by the expert kernels).
        free = tl.sum((cls == 0).to(tl.int32), axis=0)
        fit = miss & (miss_rank < free)
        over = miss & (miss_rank >= free)
        # The j-th missing expert takes the slot of rank j (and evicts what was there).
        pick = (rank[None, :] == miss_rank[:, None]) & fit[:, None]
        new_slot = tl.sum(tl.where(pick, s_r[None, :] + 1, 0), axis=1) - 1
        evicted = tl.sum(tl.where(pick, se[None, :] + 1, 0), axis=1) - 1
        slot_now = tl.where(fit, new_slot, es)  # -1 for an expert read in place
        tick = tl.load(clock) + 1
        tl.store(clock, tick)
        # Evicted experts are never needed ones, so these two stores touch different entries.
        tl.store(expert_slot + evicted, -1, mask=fit & (evicted >= 0))
        tl.store(expert_slot + e_r, new_slot, mask=fit)
        tl.store(slot_expert + new_slot, e_r, mask=fit)
        tl.store(last_used + slot_now, tick + 0 * slot_now.to(tl.int64), mask=need & (slot_now >= 0))
        # Each needed expert's outcome, looked up by every entry: (slot + 1) * 4, + 1 if it is being
        # copied in now, + 2 if it is read in place. The barrier first: every read of ``mark`` above
        # is done before it is written again.
        tl.debug_barrier()
        tl.store(mark + e_r, (slot_now + 1) * 4 + fit.to(tl.int32) + 2 * over.to(tl.int32), mask=need)
        tl.debug_barrier()
        code = tl.load(mark + ids, mask=valid, other=0)
        sid = code // 4 - 1  # -1 for a skipped entry (code 0) and for one read in place
        tl.store(slot_ids_out + n_r, sid, mask=n_r < n)
        # The same ids split by whether the entry's expert is being copied in right now.
        loading = (code % 2) == 1
        tl.store(hit_ids_out + n_r, tl.where(loading, -1, sid), mask=n_r < n)
        tl.store(miss_ids_out + n_r, tl.where(loading, sid, -1), mask=n_r < n)
        in_place = ((code // 2) % 2) == 1
        tl.store(over_ids_out + n_r, tl.where(in_place, ids, -1), mask=n_r < n)
        p_r = tl.arange(0, BP)
        at = (miss_rank[None, :] == p_r[:, None]) & fit[None, :]
        tl.store(load_e_out + p_r, tl.sum(tl.where(at, e_r[None, :] + 1, 0), axis=1) - 1, mask=p_r < P)
        tl.store(load_s_out + p_r, tl.sum(tl.where(at, new_slot[None, :] + 1, 0), axis=1) - 1, mask=p_r < P)
        was_ahead = tl.load(ahead + e_r, mask=e_ok, other=0) > 0
        if AHEAD:  # a guess: count what it loads, and mark it for the real plan to judge
            tl.store(counts + 4, tl.load(counts + 4) + tl.sum(fit.to(tl.int64), axis=0))
            tl.store(ahead + e_r, (was_ahead | fit).to(tl.int32), mask=e_ok)
        else:
            tl.store(counts, tl.load(counts) + tl.sum(hit.to(tl.int64), axis=0))
            tl.store(counts + 1, tl.load(counts + 1) + tl.sum(miss.to(tl.int64), axis=0))
            tl.store(counts + 2, tl.load(counts + 2) + T)
            tl.store(counts + 3, tl.load(counts + 3) + tl.sum(over.to(tl.int64), axis=0))
            tl.store(counts + 5, tl.load(counts + 5) + tl.sum((was_ahead & need).to(tl.int64), axis=0))
            tl.store(counts + 6, tl.load(counts + 6) + tl.sum((was_ahead & (need == 0)).to(tl.int64), axis=0))
            tl.store(ahead + e_r, 0, mask=e_ok)

    HAVE_TRITON = True
    TRITON_MISSING = ""
except Exception as exc:  # pragma: no cover - depends on the install
    HAVE_TRITON = False
    # Why not, for the warning an offload on CUDA logs: it then plans on the host.
    TRITON_MISSING = f"{type(exc).__name__}: {exc}"

# Each batch of a layer multiplies its experts' use counts by this (``policy="frequency"``): a memory
# of about a hundred batches. Under the routing stand-in 0.999 hits a little more often (82.8 against
# 81.9 %), but its popularity never changes, while a real router's moves with the text.
FREQUENCY_DECAY = 0.99

# What the device counts per layer, in this column order: experts found resident, experts missing,
# tokens, missing experts read in place (no slot), experts loaded ahead on a guess, and of those the
# ones the layer's next real batch used or did not use.
COUNTS = ("hits", "misses", "tokens", "in_place", "ahead", "ahead_used", "ahead_wasted")


@dataclass
class DevicePlan:
    """One layer's plan, all on the device: slot per (token, k) entry and the copies to make."""

    slot_ids: torch.Tensor  # [T, k] int32, -1 where the entry is skipped
    # slot_ids split in two: entries whose expert was already resident, and entries whose expert
    # is in this plan's copy list (-1 elsewhere). The first can be computed while the copy runs.
    hit_slot_ids: torch.Tensor
    miss_slot_ids: torch.Tensor
    # [T, k] int32 expert id of entries whose expert got no slot (read in place), -1 elsewhere;
    # all -1 unless the batch needs more experts than the slots hold.
    overflow_ids: torch.Tensor
    load_experts: torch.Tensor  # [P] int32 expert ids to copy in, -1 padding at the end
    load_slots: torch.Tensor  # [P] int32 destination slots, -1 padding


class DeviceSlotTables:
    """The slot tables of every layer as GPU (or CPU) tensors, planned without host reads; the expert
    evicted is the least recently used one, or the least used one (``policy``)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_slots: int,
        device: torch.device | str,
        use_triton: bool | None = None,
        policy: CachePolicy = DEFAULT_CACHE_POLICY,
    ) -> None:
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots must be in 1..{num_experts}, got {num_slots}")
        if policy not in CACHE_POLICIES:
            raise ValueError(f"the cache policy must be 'lru' or 'frequency', got {policy!r}")
        self.policy = policy
        self.device = torch.device(device)
        self.num_layers, self.num_experts, self.num_slots = num_layers, num_experts, num_slots
        if use_triton is None:
            use_triton = HAVE_TRITON and self.device.type == "cuda"
        if use_triton and not HAVE_TRITON:
            raise RuntimeError("the Triton slot planner needs Triton installed")
        self.use_triton = use_triton
        self.expert_slot = torch.full((num_layers, num_experts), -1, dtype=torch.int32, device=self.device)
        self.slot_expert = torch.full((num_layers, num_slots), -1, dtype=torch.int32, device=self.device)
        self.last_used = torch.full(
            (num_layers, num_slots), -1, dtype=torch.int64, device=self.device
        )  # clock tick of last use, -1: never
        self.clock = torch.zeros(num_layers, dtype=torch.int64, device=self.device)
        # Counted on the device, so CUDA-graph replays are counted too (columns: ``COUNTS``).
        self.counts = torch.zeros(num_layers, len(COUNTS), dtype=torch.int64, device=self.device)
        # 1 where an expert was loaded ahead on a guess and no real plan of its layer has run since.
        self.ahead = torch.zeros(num_layers, num_experts, dtype=torch.int32, device=self.device)
        # Decayed use counts per expert (``policy="frequency"``; kept, unused, under LRU).
        self.freq = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=self.device)
        # The planner kernel's scratch: one int per expert and layer (lookups by expert id).
        self.mark = torch.zeros(num_layers, num_experts, dtype=torch.int32, device=self.device)
        # A host copy of the counts, refreshed after the last layer's plan of every step (one small
        # copy, captured in the graph too), so a stats thread can read them with no CUDA call: a
        # replayed step runs no Python that could publish them.
        # Registered (not cached) pinned memory: the copy is a plain async copy, inside a capture too;
        # pageable memory would make it a synchronous one, so then there is no host copy.
        self.host_counts: torch.Tensor | None = self.counts
        if self.device.type == "cuda":
            mirror = empty_pinned((num_layers, len(COUNTS)), torch.int64).zero_()
            self.host_counts = mirror if is_pinned(mirror) else None
        self._last_read = [[0] * len(COUNTS) for _ in range(num_layers)]

    def fits(self, topk_ids: torch.Tensor) -> bool:
        """True when every entry of the batch can be resident at once (a shape check, no sync)."""
        return topk_ids.numel() <= self.num_slots

    def plan(self, layer: int, topk_ids: torch.Tensor, *, overflow: bool = False, ahead: bool = False) -> DevicePlan:
        """Assign slots for ``topk_ids`` [T, k] of ``layer``, updating the LRU state in place.

        ``overflow``: the batch may need more experts than there are slots; those left without one
        are listed in ``overflow_ids`` for the caller to read in place.
        ``ahead``: ``topk_ids`` is a guess at the layer's next batch, planned before its router ran:
        the experts it loads are counted as loaded ahead (not as hits or misses), and the layer's
        next real plan counts each of them as used or wasted."""
        if ahead:
            overflow = True  # what finds no slot is simply not fetched ahead
        if not (overflow or self.fits(topk_ids)):
            raise ValueError(
                f"{topk_ids.numel()} (token, k) entries do not fit in "
                f"{self.num_slots} slots: use the host table for this batch"
            )
        n = topk_ids.numel()
        p = min(n, self.num_slots)
        slot_ids = torch.empty(topk_ids.shape, dtype=torch.int32, device=self.device)
        hit_ids, miss_ids = torch.empty_like(slot_ids), torch.empty_like(slot_ids)
        over_ids = torch.empty_like(slot_ids)
        load_e = torch.empty(p, dtype=torch.int32, device=self.device)
        load_s = torch.empty(p, dtype=torch.int32, device=self.device)
        if self.use_triton:
            # One dtype for every router (vLLM's are int32, some int64): one kernel variant fewer.
            ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
            _plan_kernel[(1,)](
                ids,
                n,
                self.expert_slot[layer],
                self.slot_expert[layer],
                self.last_used[layer],
                self.clock[layer : layer + 1],
                self.counts[layer],
                self.ahead[layer],
                self.freq[layer],
                FREQUENCY_DECAY,
                self.mark[layer],
                slot_ids,
                hit_ids,
                miss_ids,
                over_ids,
                load_e,
                load_s,
                self.num_experts,
                self.num_slots,
                p,
                topk_ids.shape[0],
                BN=block(n),
                BE=block(self.num_experts),
                BS=block(self.num_slots),
                BP=block(p),
                AHEAD=ahead,
                FREQ=self.policy == "frequency",
                num_warps=4,
            )
        else:
            self._plan_torch(layer, topk_ids, slot_ids, over_ids, load_e, load_s, ahead)
            loaded = torch.zeros(self.num_experts + 1, dtype=torch.bool, device=self.device)
            loaded[torch.where(load_e >= 0, load_e.long(), self.num_experts)] = True
            loading = loaded[torch.where(topk_ids >= 0, topk_ids.long(), self.num_experts)]
            hit_ids.copy_(torch.where(loading, -1, slot_ids))
            miss_ids.copy_(torch.where(loading, slot_ids, -1))
        if layer == self.num_layers - 1 and self.host_counts is not None and self.host_counts is not self.counts:
            self.host_counts.copy_(self.counts, non_blocking=True)
        return DevicePlan(slot_ids, hit_ids, miss_ids, over_ids, load_e, load_s)

    def warm_up(self, max_tokens: int, top_k: int, *, ahead: bool = False) -> list[int]:
        """Plan one batch of each size of ``warm_up_tokens`` on a scratch table of one layer, so the
        planner kernel is compiled for every batch it may plan before the first request; these
        tables, their counts and their host mirror are left as they were. ``ahead``: also the
        variant that plans a guess (``moe_fetch_ahead``). Returns the sizes planned; none on the torch
        path, which compiles nothing."""
        if not self.use_triton:
            return []
        scratch = DeviceSlotTables(
            1, self.num_experts, self.num_slots, self.device, use_triton=self.use_triton, policy=self.policy
        )
        sizes = warm_up_tokens(max_tokens, top_k)
        for tokens in sizes:
            ids = torch.arange(tokens * top_k, device=self.device, dtype=torch.int32) % self.num_experts
            ids = ids.reshape(tokens, top_k)
            scratch.plan(0, ids, overflow=True)
            if ahead:
                scratch.plan(0, ids, ahead=True)
        # Each plan of the scratch's last (only) layer queued a copy into its pinned host mirror:
        # done before the mirror is freed with the scratch.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return sizes

    def _plan_torch(self, layer, topk_ids, slot_ids, over_ids, load_e, load_s, ahead: bool) -> None:
        """The kernel's algorithm in torch ops (no host reads either): CPU and no-Triton path."""
        E, S, p = self.num_experts, self.num_slots, load_e.shape[0]
        ids = topk_ids.reshape(-1).long()
        valid = ids >= 0
        need = torch.zeros(E + 1, dtype=torch.bool, device=self.device)
        need[torch.where(valid, ids, E)] = True  # index E: a bin for skipped entries
        need = need[:E]
        es, se = self.expert_slot[layer], self.slot_expert[layer]
        lu = self.last_used[layer]
        hit, miss = need & (es >= 0), need & (es < 0)
        held = (se >= 0) & need[se.long().clamp_min(0)]
        # Stable sort by (held, last use): ties keep the lower slot first, as in the kernel.
        order = torch.sort(held.long() * (1 << 62) + (lu + 1), stable=True).indices
        if self.policy == "frequency":  # by (held, decayed count, last use, slot)
            f = self.freq[layer]
            if not ahead:
                f.mul_(FREQUENCY_DECAY).add_(need.float())
            key = torch.where(se >= 0, f[se.long().clamp_min(0)], -1.0)
            order = order[torch.sort(key[order], stable=True).indices]
            order = order[torch.sort(held[order].long(), stable=True).indices]
        miss_rank = torch.cumsum(miss.long(), 0) - 1
        # Slots holding no needed expert; the missing experts past that many are read in place.
        free = (~held).sum()
        fit, over = miss & (miss_rank < free), miss & (miss_rank >= free)
        new_slot = order[miss_rank.clamp(0, S - 1)]
        evicted = se.long()[new_slot]
        slot_now = torch.where(fit, new_slot, es.long())
        self.clock[layer] += 1
        drop = torch.where(fit & (evicted >= 0), evicted, E)
        es_ext = torch.cat([es, es.new_full((1,), -1)])  # index E: where masked writes go
        es_ext[drop] = -1
        es_ext[torch.where(fit, torch.arange(E, device=self.device), E)] = new_slot.int()
        es.copy_(es_ext[:E])
        se_ext = torch.cat([se, se.new_full((1,), -1)])
        se_ext[torch.where(fit, new_slot, S)] = torch.arange(E, device=self.device, dtype=torch.int32)
        se.copy_(se_ext[:S])
        lu_ext = torch.cat([lu, lu.new_full((1,), -1)])
        lu_ext[torch.where(need & (slot_now >= 0), slot_now, S)] = self.clock[layer]
        lu.copy_(lu_ext[:S])
        slot_ids.copy_(torch.where(valid, slot_now[ids.clamp_min(0)], -1).view(slot_ids.shape))
        over_ids.copy_(torch.where(valid & over[ids.clamp_min(0)], ids, -1).view(over_ids.shape))
        # Missing experts given a slot, in id order, then padding; the j-th one goes to its new slot.
        pos = torch.where(fit, miss_rank, p).clamp_max(p)
        le = torch.full((p + 1,), -1, dtype=torch.int64, device=self.device)
        ls = le.clone()
        le[pos] = torch.arange(E, device=self.device)
        ls[pos] = new_slot
        load_e.copy_(le[:p])
        load_s.copy_(ls[:p])
        was_ahead = self.ahead[layer] > 0
        if ahead:
            self.counts[layer, 4] += fit.sum()
            self.ahead[layer] = (was_ahead | fit).int()
            return
        self.counts[layer, 0] += hit.sum()
        self.counts[layer, 1] += miss.sum()
        self.counts[layer, 2] += topk_ids.shape[0]
        self.counts[layer, 3] += over.sum()
        self.counts[layer, 5] += (was_ahead & need).sum()
        self.counts[layer, 6] += (was_ahead & ~need).sum()
        self.ahead[layer] = 0

    # -- hand-over with the host table (the host path runs for batches that do not fit) ------

    def export(self, layer: int) -> list[tuple[int, int]]:
        """(expert, slot) pairs of ``layer``, least recently used first (reads the device)."""
        se = self.slot_expert[layer].tolist()
        lu = self.last_used[layer].tolist()
        order = sorted(range(self.num_slots), key=lambda s: (lu[s], s))
        return [(se[s], s) for s in order if se[s] >= 0]

    def load(self, layer: int, lru_pairs: list[tuple[int, int]]) -> None:
        """Replace ``layer``'s state with (expert, slot) pairs given least recently used first."""
        es = torch.full((self.num_experts,), -1, dtype=torch.int32)
        se = torch.full((self.num_slots,), -1, dtype=torch.int32)
        lu = torch.full((self.num_slots,), -1, dtype=torch.int64)
        for tick, (e, s) in enumerate(lru_pairs):
            es[e], se[s], lu[s] = s, e, tick
        self.expert_slot[layer].copy_(es)
        self.slot_expert[layer].copy_(se)
        self.last_used[layer].copy_(lu)
        self.clock[layer] = len(lru_pairs)
        self.ahead[layer] = 0  # the host table judged nothing: what was loaded ahead is plain cache now

    def reset_counts(self) -> None:
        self.counts.zero_()
        self.ahead.zero_()
        if self.host_counts is not None:
            self.host_counts.zero_()
        self._last_read = [[0] * len(COUNTS) for _ in self._last_read]

    def read_counts(self, *, sync: bool = True) -> list[list[int]]:
        """One row of ``COUNTS`` per layer. ``sync=False`` makes no CUDA call
        (safe from another thread, even during a graph capture): the host copy as of the last
        whole step, or without one the last synced read."""
        if sync:
            self._last_read = self.counts.tolist()
            return self._last_read
        return self.host_counts.tolist() if self.host_counts is not None else self._last_read
