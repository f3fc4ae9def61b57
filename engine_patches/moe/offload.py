"""The runtime: run MoE layers whose experts live in host memory.

Two modes, chosen per engine:
- ``cached``: each layer owns a few GPU slots managed as an LRU. Per layer and batch the router's
  top-k ids say which experts are needed; only the missing ones are copied. Two planners:
  - device (decode-sized batches, tokens * top_k <= slots): the slot tables live on the GPU
    (``DeviceSlotTables``); one planning kernel turns the ids into slots and a padded copy list,
    and one gather launch fetches both weight tensors of the missing experts straight from pinned
    host memory. No host read, no sync: the whole step can be one CUDA graph. This is what makes
    batch 1 fast. For one token the gather is folded into the expert kernels instead
    (``fetch_experts``: missing experts are computed from host memory as they are read, resident
    ones while the link is busy). ``device_overlap`` computes the resident experts beside the
    gather. With a device view of host memory (``stream_view``), batches of up to
    ``in_place_tokens`` tokens are planned there too even when their experts may not all fit: the
    missing experts get the slots this batch does not use, and the expert kernels read the rest in
    place from host memory, in a second pass (``in_place_fn``). So batch 8 or 16 stays in a graph
    at a small cache, and a step never waits on the host.
  - host (larger batches): the ids are read on the host (one small sync per layer), the
    ``ExpertSlotTable`` plans rounds when the batch needs more experts than there are slots, and
    the copies run on a side stream while the resident experts are computed.
  The two hand the LRU state over when the batch size crosses the line.
  Fetching ahead (``guess_next``, device planner only): while layer L runs, a guess at layer L+1's
  experts (its router applied to layer L's input, say) is planned into L+1's slots and gathered on
  the side stream, so the link works through the rest of layer L and layer L+1's attention. Layer
  L+1's real plan then finds the guessed experts resident and fetches only what the guess missed;
  the device counts what was loaded ahead, and of it what the real batch used and what it wasted.
- ``copy_all`` (the plain way, kept as the baseline): every expert of the layer is copied into one
  of two staging buffers; while layer L computes from one buffer, layer L+1 is copied into the other
  (ping-pong), so copies overlap compute but every byte still crosses the link every step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal, TypedDict

import torch

from .device_slots import HAVE_TRITON, TRITON_MISSING, DevicePlan, DeviceSlotTables
from .experts import ExpertsFn, auto_experts, split_experts, splits_cheaply
from .fetch_experts import fetch_and_compute, fetches_in_kernel
from .gather import CopyMethod, copy_expert_pairs_indexed, copy_experts
from .sizing import (
    CACHE_POLICIES,
    DEFAULT_CACHE_POLICY,
    KERNEL_WARM_UP_TOKENS,
    CachePolicy,
    device_planned_tokens,
    slots_for_budget,
)
from .slots import ExpertSlotTable
from .stats import ExpertCacheStats
from .store import ExpertStore

log = logging.getLogger(__name__)

OffloadMode = Literal["cached", "copy_all"]
Planner = Literal["auto", "host", "device"]


class GatherTuning(TypedDict):
    """Launch shape of the Triton gather (``copy_expert_pairs_indexed``'s keyword arguments)."""

    block: int
    num_warps: int
    programs: int


def staging_plan(overflow_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a batch's experts left without a cache slot go in the staging buffer, with no host read.

    ``overflow_ids`` [T, k]: the expert of each entry that got no slot, -1 elsewhere. Each such expert
    gets the staging row of its rank among them, in expert id order. Returns the staging row of each
    entry (-1 elsewhere) and the copies to make, as fixed-size lists of one entry per expert: expert
    ids and their rows, -1 for experts not left out. Fixed sizes keep it inside a CUDA graph."""
    flat = overflow_ids.reshape(-1).long()
    left_out = flat >= 0
    present = torch.zeros(num_experts + 1, dtype=torch.long, device=overflow_ids.device)
    present.index_fill_(0, torch.where(left_out, flat, num_experts), 1)  # row num_experts: the -1s
    present = present[:num_experts]
    rank = present.cumsum(0) - 1
    experts = torch.arange(num_experts, device=overflow_ids.device)
    load_experts = torch.where(present > 0, experts, -1).to(overflow_ids.dtype)
    load_rows = torch.where(present > 0, rank, -1).to(overflow_ids.dtype)
    rows = torch.where(left_out, rank[flat.clamp_min(0)], -1).to(overflow_ids.dtype).view_as(overflow_ids)
    return rows, load_experts, load_rows


class ExpertOffload:
    """GPU side of the expert store: cache slots (or staging buffers), copy stream, counters."""

    def __init__(
        self,
        store: ExpertStore,
        *,
        device: torch.device | str,
        mode: OffloadMode = "cached",
        slots_per_layer: int | None = None,
        copy_method: CopyMethod = "memcpy",
        overlap: bool = True,
        measure_copy_time: bool = False,
        experts_fn: ExpertsFn = auto_experts,
        planner: Planner = "auto",
        gather_block: int = 4096,
        gather_warps: int = 4,
        gather_programs: int = 0,
        device_overlap: bool = False,
        fetch_in_kernel: bool = True,
        stream_view: Callable[[torch.Tensor], torch.Tensor] | None = None,
        stream_below_hit_rate: float = 0.0,
        in_place_tokens: int = 0,
        ahead_programs: int = 24,
        ahead_priority: int = 0,
        cache_policy: CachePolicy = DEFAULT_CACHE_POLICY,
        stage_overflow: bool = False,
    ) -> None:
        if not store.layers:
            raise ValueError("the expert store is empty: add every MoE layer before building the cache")
        if mode not in ("cached", "copy_all"):
            raise ValueError(f"moe_mode must be 'cached' or 'copy_all', got {mode!r}")
        if cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy must be 'lru' or 'frequency', got {cache_policy!r}")
        self.store = store
        self.pinned = store.pinned  # asked once: each ask is a CUDA call per tensor
        self.device = torch.device(device)
        self.mode = mode
        self.copy_method = copy_method
        self.overlap = overlap
        # Device planner: compute the resident experts while the missing ones load (two more
        # launches per layer). Off by default: on the H200 at batch 1 the extra launches and the
        # SMs the gather shares cost as much as the overlap hides (bench/README.md, run 5).
        self.device_overlap = device_overlap
        # Device planner, one token: the expert kernels read the missing experts from host memory
        # themselves and leave them in their slots (``fetch_experts``), so the resident experts'
        # math runs while the link is busy, with no gather launch in between.
        self.fetch_in_kernel = fetch_in_kernel
        self.measure = measure_copy_time
        self.experts_fn = experts_fn
        # Host path, a batch whose experts do not fit in the cache at once: rounds through the cache
        # copy each expert in, compute, and evict it for the next round, one round after another.
        # When fewer than ``stream_below_hit_rate`` of its experts are resident, the expert kernels
        # read them all in place from host memory instead (``stream_view``: a device view of a
        # pinned host tensor, UVA on CUDA), as vLLM's own expert offload does: the same bytes over
        # the link, read inside the kernels, and the cache left as it was. 0 (or no view): rounds.
        if not 0.0 <= stream_below_hit_rate <= 1.0:
            raise ValueError(f"stream_below_hit_rate must be in 0..1, got {stream_below_hit_rate}")
        self._stream_view = stream_view
        self.stream_below_hit_rate = stream_below_hit_rate
        # Device planner: batches of up to this many tokens whose experts may not fit in the slots
        # (more than slots/top_k tokens) are still planned on the device, the experts left without a
        # slot read in place through ``stream_view``. 0 (or no view): such batches go to the host.
        if in_place_tokens < 0:
            raise ValueError(f"in_place_tokens must be >= 0, got {in_place_tokens}")
        self.in_place_tokens = in_place_tokens if stream_view is not None else 0
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # layer -> (event, plan) of a fetch ahead not yet waited for; the plan's tensors are kept
        # until then, so the allocator cannot hand them out while the side stream reads them.
        self._ahead_pending: dict[int, tuple[torch.cuda.Event | None, DevicePlan]] = {}
        self._streamed_calls = self._streamed_bytes = 0
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        # Fetches ahead get a stream of their own: a layer's own copies on the copy stream must not
        # queue behind the next layer's guess.
        # ``ahead_priority``: the stream's priority (lower runs first, as CUDA counts). It holds in
        # graphs too: PyTorch instantiates them to use each kernel's priority from its capture stream.
        # A higher one made steps slower on an H100 (bench/README.md), so 0 by default.
        self._ahead_stream = torch.cuda.Stream(self.device, priority=ahead_priority) if self._cuda else None
        num_experts = store.layers[0].num_experts
        self.num_experts = num_experts

        self._device: DeviceSlotTables | None = None
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None
        if mode == "cached":
            slots = slots_per_layer or num_experts
            if not 1 <= slots <= num_experts:
                raise ValueError(f"slots_per_layer must be in 1..{num_experts}, got {slots}")
            self.slots_per_layer = slots
            self._tables = [ExpertSlotTable(lay.num_experts, slots) for lay in store.layers]
            self._slots = [self._empty_like_rows(lay.w13, lay.w2, slots) for lay in store.layers]
            if planner not in ("auto", "host", "device"):
                raise ValueError(f"planner must be 'auto', 'host' or 'device', got {planner!r}")
            # On CUDA the device planner needs the Triton gather (the torch one reads back ids).
            possible = not self._cuda or HAVE_TRITON
            if not possible and planner == "auto":
                log.warning(
                    "engine_patches: Triton is not usable (%s): expert batches are planned on the host, "
                    "each layer reading the router's choices back, which a CUDA graph cannot hold: "
                    "serve with --enforce-eager",
                    TRITON_MISSING,
                )
            if planner == "device" and not possible:
                raise RuntimeError("planner='device' needs Triton on CUDA; use planner='host'")
            # ``cache_policy``: which expert the device planner evicts (the host table's is LRU).
            self._device = (
                DeviceSlotTables(len(store.layers), num_experts, slots, self.device, policy=cache_policy)
                if planner != "host" and possible
                else None
            )
            # Device planner, a batch past the cache: its experts left without a slot are gathered
            # into a staging buffer of one layer's size, less the slots (never more are left out),
            # at the gather's speed, and computed there, instead of read in place by the expert
            # kernels. The buffer is one for all layers: they run one after another on one stream.
            if stage_overflow and self._device is not None and self.in_place_tokens > 0 and slots < num_experts:
                first = store.layers[0]
                self._staging = self._empty_like_rows(first.w13, first.w2, num_experts - slots)
            # True where the device tables changed since the host table last saw them.
            self._host_stale = [False] * len(store.layers)
            # Once a device plan was captured in a CUDA graph, replays change the device tables
            # with no Python running to set _host_stale: the host table must reload every time.
            self._graph_captured = False
            self._gather_kw = GatherTuning(block=gather_block, num_warps=gather_warps, programs=gather_programs)
            # The gather of a fetch ahead runs beside the compute stream on a small grid: the more
            # SMs it reads host memory from, the slower the compute stream's own small kernels run
            # beside it (two to three times as slow at 64 programs on the H200, in traces of one
            # step), while 8 or 16 programs slow the gather itself. Of 24, 32, 48 and 64 programs,
            # 24 made the fastest steps in five of six cases (bench/moe_fetch_ahead.py).
            if ahead_programs < 1:
                raise ValueError(f"ahead_programs must be >= 1, got {ahead_programs}")
            self._ahead_kw = GatherTuning(block=gather_block, num_warps=gather_warps, programs=ahead_programs)
        else:
            first = store.layers[0]
            for lay in store.layers:
                if lay.w13.shape != first.w13.shape or lay.w2.shape != first.w2.shape:
                    raise ValueError("copy_all mode needs every MoE layer to have the same expert shapes")
            self.slots_per_layer = num_experts
            self._buffers = [self._empty_like_rows(first.w13, first.w2, num_experts) for _ in range(2)]
            self._buffer_layer: list[int | None] = [None, None]
            self._buffer_ready: list[torch.cuda.Event | None] = [None, None]
            self._last_buffer = 1

        # The eviction rule in force: the device planner's, or LRU where only the host table plans.
        self.cache_policy: CachePolicy = cache_policy if self._device is not None else "lru"
        self._hits = self._misses = self._bytes = self._tokens_in = 0
        self._copy_s = self._exposed_s = 0.0
        self._untimed_calls = 0  # fetch-path calls: their copies are inside the expert kernels
        self._copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._critical_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @classmethod
    def from_budget(
        cls, store: ExpertStore, cache_gib: float, *, top_k: int, device: torch.device | str, **kwargs
    ) -> ExpertOffload:
        """Size the per-layer slots from a GiB budget (the same arithmetic the planner uses)."""
        lay = store.layers[0]
        slots = slots_for_budget(
            cache_gib,
            num_experts=lay.num_experts,
            num_layers=len(store.layers),
            one_expert_bytes=lay.expert_bytes,
            top_k=top_k,
        )
        return cls(store, device=device, slots_per_layer=slots, **kwargs)

    def _empty_like_rows(self, w13: torch.Tensor, w2: torch.Tensor, rows: int):
        # Zeros, not leftover memory: a skipped entry is computed from row 0 with weight 0 before any
        # expert is copied there, and 0 x a NaN bit pattern would still be NaN in the output.
        return (
            torch.zeros((rows, *w13.shape[1:]), dtype=w13.dtype, device=self.device),
            torch.zeros((rows, *w2.shape[1:]), dtype=w2.dtype, device=self.device),
        )

    @property
    def num_layers(self) -> int:
        return len(self.store.layers)

    @property
    def gpu_cache_bytes(self) -> int:
        pairs = self._slots if self.mode == "cached" else self._buffers
        return sum(t.numel() * t.element_size() for pair in pairs for t in pair) + self.staging_bytes

    @property
    def staging_bytes(self) -> int:
        """GPU bytes of the staging buffer (``stage_overflow``); 0 without one."""
        if self._staging is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._staging)

    # -- copies -------------------------------------------------------------------------------

    def _copy(
        self, layer: int, dst: tuple[torch.Tensor, torch.Tensor], loads: list[tuple[int, int]]
    ) -> torch.cuda.Event | None:
        """Start the copies of ``loads`` into ``dst``; returns the event the compute must wait on."""
        if not loads:
            return None
        src = self.store.layers[layer]
        experts = [e for e, _ in loads]
        slots = [s for _, s in loads]
        if not self._cuda:
            t0 = time.perf_counter()
            self._bytes += copy_experts(src.w13, dst[0], experts, slots, self.copy_method)
            self._bytes += copy_experts(src.w2, dst[1], experts, slots, self.copy_method)
            dt = time.perf_counter() - t0
            self._copy_s += dt
            self._exposed_s += dt  # a synchronous copy hides nothing
            return None
        stream = self._copy_stream
        assert stream is not None  # made in __init__ on CUDA
        # A slot may still be read by compute queued earlier on the main stream: wait for it.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True) if self.measure else None
            if start is not None:
                start.record(stream)
            self._bytes += copy_experts(src.w13, dst[0], experts, slots, self.copy_method)
            self._bytes += copy_experts(src.w2, dst[1], experts, slots, self.copy_method)
            ready = torch.cuda.Event(enable_timing=self.measure)
            ready.record(stream)
        if start is not None:
            self._copy_events.append((start, ready))
        return ready

    def _wait(self, ready: torch.cuda.Event | None) -> None:
        if ready is None:
            return
        main = torch.cuda.current_stream(self.device)
        if not self.measure or torch.cuda.is_current_stream_capturing():  # no timed events in a capture
            main.wait_event(ready)
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(main)
        main.wait_event(ready)
        after.record(main)
        self._wait_events.append((before, after))

    def _gather_now(self, weights: tuple[torch.Tensor, torch.Tensor], dst, plan: DevicePlan) -> None:
        """Off CUDA: ``plan``'s copies, made here and now, timed as copy time that hides nothing."""
        t0 = time.perf_counter()
        copy_expert_pairs_indexed(weights, dst, plan.load_experts, plan.load_slots)
        dt = time.perf_counter() - t0
        self._copy_s += dt
        self._exposed_s += dt

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts_fn: ExpertsFn | None = None,
        *,
        own_math: bool = False,
        in_place_fn: ExpertsFn | None = None,
        guess_next: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The MoE output of ``layer`` for hidden states ``x`` [T, H] routed by ``topk_ids`` [T, k].

        ``own_math``: ``experts_fn`` computes the plain silu-gated MoE, so for one token the
        runtime may use its own kernels instead (the fetch path). ``in_place_fn``: the experts
        function for the pass over host memory (expert ids, -1 skipped); ``experts_fn`` if None.
        ``guess_next``: ``x`` -> guessed expert ids [T, k] of the next layer, whose experts are then
        fetched ahead while this layer computes. Where the step runs in a CUDA graph, the graph must
        hold the next layer's forward too (a full graph, not one piece per layer): it waits there."""
        fn = experts_fn or self.experts_fn
        if self.plans_on_device(topk_ids):  # counts its tokens on the device; waits after its own fetch ahead
            ahead = None
            if guess_next is not None and layer + 1 < self.num_layers:

                def ahead() -> None:
                    self._fetch_ahead(layer + 1, guess_next(x))

            if self._device is not None and not self._device.fits(topk_ids):
                return self._forward_device_in_place(layer, x, topk_weights, topk_ids, fn, in_place_fn or fn, ahead)
            return self._forward_device(layer, x, topk_weights, topk_ids, fn, own_math or fn is auto_experts, ahead)
        self._join_ahead(layer)
        self._tokens_in += x.shape[0]
        if self.mode == "copy_all":
            return self._forward_copy_all(layer, x, topk_weights, topk_ids, fn)
        return self._forward_cached(layer, x, topk_weights, topk_ids, fn)

    def warm_up_planner(self, top_k: int, *, ahead: bool = False) -> list[int]:
        """Compile the GPU planner for every batch size it may plan (``DeviceSlotTables.warm_up``),
        so the first batch of a new size (17 to 64 tokens run outside CUDA graphs) does not wait
        seconds for a compile. Returns the batch sizes planned; none without the device planner, on
        the torch path (nothing to compile), or inside a CUDA graph capture (its launches would join
        the graph)."""
        if self._device is None or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return []
        most = device_planned_tokens(self.slots_per_layer, top_k, self.in_place_tokens)
        return self._device.warm_up(most, top_k, ahead=ahead)

    def warm_up_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        experts_fn: ExpertsFn,
        in_place_fn: ExpertsFn | None = None,
        most: int = KERNEL_WARM_UP_TOKENS,
    ) -> tuple[int, int]:
        """Run the expert kernels once for every batch size from 1 to ``most`` tokens, on zeros shaped
        like ``x`` and ``topk_weights``, so that kernels compiled per batch size (vLLM's Triton
        ``fused_moe_kernel``) compile while the engine starts, not at a request's first batch of a new
        size. The pass over the cache slots (every planner), then the pass that reads experts in place
        (up to the device planner's bound), with every entry skipped: no expert crosses the link where
        the kernel skips by an expert map (else each call reads one). The
        cache, its tables and its counts are not touched. Returns the largest size of each pass;
        (0, 0) in copy_all mode or inside a CUDA graph capture."""
        if self.mode != "cached" or most < 1 or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return 0, 0
        k = topk_weights.shape[-1]
        zeros = x.new_zeros((most, x.shape[-1]))
        weights = topk_weights.new_zeros((most, k))

        def each_size(fn: ExpertsFn, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> None:
            for tokens in range(1, ids.shape[0] + 1):
                fn(zeros[:tokens], w13, w2, weights[:tokens], ids[:tokens])

        def spread(tokens: int, rows: int) -> torch.Tensor:  # valid ids over ``rows`` rows
            return (torch.arange(tokens * k, device=x.device) % rows).view(tokens, k)

        w13, w2 = self._slots[0]
        each_size(experts_fn, w13, w2, spread(most, self.slots_per_layer))
        in_place = min(most, device_planned_tokens(self.slots_per_layer, k, self.in_place_tokens))
        if self._staging is not None:  # the staging pass: its own expert count, its own compiles
            each_size(experts_fn, *self._staging, spread(in_place, self._staging[0].shape[0]))
        elif in_place_fn is not None and self.in_place_tokens > 0 and self._device is not None:
            each_size(in_place_fn, *self._view(0), torch.full((in_place, k), -1, dtype=torch.long, device=x.device))
        else:
            in_place = 0
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return most, in_place

    def plans_on_device(self, topk_ids: torch.Tensor) -> bool:
        """Whether this batch runs without host reads (and so may be captured in a CUDA graph)."""
        if self.mode != "cached" or self._device is None:
            return False
        return self._device.fits(topk_ids) or topk_ids.shape[0] <= self.in_place_tokens

    def _forward_device_in_place(self, layer, x, topk_weights, topk_ids, fn, in_place_fn, ahead) -> torch.Tensor:
        """A batch that may need more experts than the slots hold, planned on the device: the
        missing experts that find a free slot are gathered into it, the rest read in place."""
        plan = self._plan_on_device(layer, topk_ids, overflow=True)
        if ahead is not None:
            ahead()
        self._join_ahead(layer)
        src, dst = self.store.layers[layer], self._slots[layer]
        if self._cuda:
            copy_expert_pairs_indexed((src.w13, src.w2), dst, plan.load_experts, plan.load_slots, **self._gather_kw)
            self._untimed_calls += 1  # the in-place reads are inside the expert kernels
        else:
            self._gather_now((src.w13, src.w2), dst, plan)
        out = fn(x, dst[0], dst[1], topk_weights, plan.slot_ids)
        if self._staging is not None:
            staged_ids, load_experts, load_rows = staging_plan(plan.overflow_ids, self.num_experts)
            # The gather's tuning counts on CUDA only; off it, the same copy in torch.
            copy_expert_pairs_indexed((src.w13, src.w2), self._staging, load_experts, load_rows, **self._gather_kw)
            return out + fn(x, self._staging[0], self._staging[1], topk_weights, staged_ids)
        w13, w2 = self._view(layer)
        return out + in_place_fn(x, w13, w2, topk_weights, plan.overflow_ids)

    def _plan_on_device(
        self, layer: int, topk_ids: torch.Tensor, *, overflow: bool = False, ahead: bool = False
    ) -> DevicePlan:
        """The device tables' plan for this batch; the host table is stale from here on."""
        assert self._device is not None  # plans_on_device() said so
        plan = self._device.plan(layer, topk_ids, overflow=overflow, ahead=ahead)
        self._host_stale[layer] = True
        if self._cuda and torch.cuda.is_current_stream_capturing():
            self._graph_captured = True
        return plan

    def _fetch_ahead(self, layer: int, guess_ids: torch.Tensor) -> None:
        """Plan ``guess_ids`` into ``layer``'s slots and start gathering what is missing, on the
        side stream; ``layer``'s forward waits for it (``_join_ahead``)."""
        device = self._device
        if device is None or not (device.fits(guess_ids) or guess_ids.shape[0] <= self.in_place_tokens):
            return
        plan = self._plan_on_device(layer, guess_ids, ahead=True)
        weights, dst = (self.store.layers[layer].w13, self.store.layers[layer].w2), self._slots[layer]
        if not self._cuda:
            self._gather_now(weights, dst, plan)
            self._ahead_pending[layer] = (None, plan)
            return
        timed = self.measure and not torch.cuda.is_current_stream_capturing()
        ready = self._gather_on_side(self._ahead_stream, weights, dst, plan, self._ahead_kw, timed)
        self._ahead_pending[layer] = (ready, plan)

    def _gather_on_side(
        self, side: torch.cuda.Stream | None, weights, dst, plan: DevicePlan, tuning: GatherTuning, timed: bool
    ) -> torch.cuda.Event:
        """Start ``plan``'s gather on ``side``, after the work queued so far on the compute stream
        (the plan, and earlier reads of the slots it overwrites); returns its end event."""
        main = torch.cuda.current_stream(self.device)
        assert side is not None  # made in __init__ on CUDA
        side.wait_stream(main)
        with torch.cuda.stream(side):
            start = torch.cuda.Event(enable_timing=True) if timed else None
            if start is not None:
                start.record(side)
            copy_expert_pairs_indexed(weights, dst, plan.load_experts, plan.load_slots, **tuning)
            ready = torch.cuda.Event(enable_timing=timed)
            ready.record(side)
        if start is not None:
            self._copy_events.append((start, ready))
        return ready

    def _join_ahead(self, layer: int) -> None:
        """The compute stream waits for ``layer``'s fetch ahead, if one was started."""
        pending = self._ahead_pending.pop(layer, None)
        if pending is not None:
            self._wait(pending[0])  # timed, the time the layer sat waiting on it counts as exposed

    def _view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device views of ``layer``'s host experts, for the expert kernels to read in place."""
        if layer not in self._views:
            assert self._stream_view is not None  # callers check
            lay = self.store.layers[layer]
            self._views[layer] = (self._stream_view(lay.w13), self._stream_view(lay.w2))
        return self._views[layer]

    def _forward_device(self, layer, x, topk_weights, topk_ids, fn, own_math, ahead) -> torch.Tensor:
        plan = self._plan_on_device(layer, topk_ids)
        # The next layer's fetch ahead starts before this layer waits for its own: the plans touch
        # only the tables, so the side stream can go from one layer's experts to the next one's
        # with no gap, while this layer's math waits for its own experts.
        if ahead is not None:
            ahead()
        self._join_ahead(layer)
        src, dst = self.store.layers[layer], self._slots[layer]
        weights = (src.w13, src.w2)
        if not self._cuda:  # a plain copy, then the two passes the GPU path runs
            self._gather_now(weights, dst, plan)
            if self.device_overlap:
                return split_experts(
                    fn, x, dst[0], dst[1], topk_weights, plan.hit_slot_ids, plan.miss_slot_ids, lambda: None
                )
            return fn(x, dst[0], dst[1], topk_weights, plan.slot_ids)
        # Events cannot be timed inside a graph capture, so only eager runs are timed.
        timed = self.measure and not torch.cuda.is_current_stream_capturing()
        if (
            self.fetch_in_kernel
            and not self.device_overlap
            and own_math
            and fetches_in_kernel(x, plan.slot_ids.numel())
        ):
            # Copy and math are one kernel here, so no copy time can be told apart: the stats
            # say "not timed" rather than count the math as copying.
            self._untimed_calls += 1
            return fetch_and_compute(x, dst, weights, topk_weights, topk_ids, plan.slot_ids, plan.miss_slot_ids)
        if not (self.device_overlap and splits_cheaply(fn, x, plan.slot_ids)):
            # The gather on the compute stream: the layer waits for all of it (all exposed).
            if timed:
                gather_start, gather_end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                gather_start.record()
            copy_expert_pairs_indexed(weights, dst, plan.load_experts, plan.load_slots, **self._gather_kw)
            if timed:
                gather_end.record()
                self._critical_events.append((gather_start, gather_end))
            return fn(x, dst[0], dst[1], topk_weights, plan.slot_ids)
        # The gather on the side stream while the main stream computes the experts that were
        # already resident; only the loaded ones wait for it. The side stream first waits for
        # the plan and for earlier reads of the slots it overwrites (both on the main stream).
        # The plan's tensors outlive the copy: the main stream waits for the side stream before
        # this function returns, so the allocator cannot hand them out while the gather reads.
        ready = self._gather_on_side(self._copy_stream, weights, dst, plan, self._gather_kw, timed)
        return split_experts(
            fn, x, dst[0], dst[1], topk_weights, plan.hit_slot_ids, plan.miss_slot_ids, lambda: self._wait(ready)
        )

    def _forward_cached(self, layer, x, topk_weights, topk_ids, fn) -> torch.Tensor:
        table = self._tables[layer]
        if self._device is not None and (self._host_stale[layer] or self._graph_captured):
            table.load_lru(self._device.export(layer))
            self._host_stale[layer] = False
        slots = self._slots[layer]
        needed = [e for e in torch.unique(topk_ids.detach().to("cpu")).tolist() if e >= 0]
        resident = table.resident()
        found = [e for e in needed if e in resident]
        if (
            self._stream_view is not None
            and self.stream_below_hit_rate > 0
            and len(needed) > table.num_slots
            and len(found) < self.stream_below_hit_rate * len(needed)
        ):
            return self._forward_streamed(layer, x, topk_weights, topk_ids, fn, len(needed))
        # Resident experts go first so the first round computes them while the rest load.
        order = found + [e for e in needed if e not in resident]
        out = None
        for start in range(0, len(order), table.num_slots):
            plan = table.assign(order[start : start + table.num_slots])
            self._hits += len(plan.hits)
            self._misses += len(plan.loads)
            ready = self._copy(layer, slots, plan.loads)
            loaded = {e: s for e, s in plan.loads}
            if self.overlap and ready is not None and plan.hits:
                passes = [{e: plan.slot_of[e] for e in plan.hits}, loaded]
            else:
                passes = [plan.slot_of]
            luts = self._lookup_tables(passes)
            for i, lut in enumerate(luts):
                if i == len(luts) - 1:
                    self._wait(ready)  # only the last pass reads slots that are being filled
                y = fn(x, slots[0], slots[1], topk_weights, lut[topk_ids.long()])
                out = y if out is None else out + y
        if self._device is not None:  # keep the device tables current for the next small batch
            self._device.load(layer, table.lru_pairs())
        return out if out is not None else torch.zeros_like(x)

    def _forward_streamed(self, layer, x, topk_weights, topk_ids, fn, distinct: int) -> torch.Tensor:
        """Every routed expert of this layer read in place from host memory by the expert kernels."""
        self._streamed_calls += 1
        self._streamed_bytes += distinct * self.store.layers[layer].expert_bytes
        w13, w2 = self._view(layer)
        return fn(x, w13, w2, topk_weights, topk_ids)

    def _lookup_tables(self, passes: list[dict[int, int]]) -> torch.Tensor:
        """Expert id -> slot (-1: not in this pass), one row per pass, uploaded in one copy."""
        lut = torch.full((len(passes), self.num_experts), -1, dtype=torch.int32)
        for row, mapping in enumerate(passes):
            if mapping:
                lut[row, list(mapping)] = torch.tensor(list(mapping.values()), dtype=torch.int32)
        if self._cuda:  # pinned + async: the host does not wait for the main stream to drain
            return lut.pin_memory().to(self.device, non_blocking=True)
        return lut

    def _forward_copy_all(self, layer, x, topk_weights, topk_ids, fn) -> torch.Tensor:
        all_rows = [(e, e) for e in range(self.num_experts)]
        if layer in self._buffer_layer:
            buf = self._buffer_layer.index(layer)
            ready = self._buffer_ready[buf]
        else:  # not prefetched (first call, or layers called out of order): load it now
            buf = 1 - self._last_buffer
            ready = self._stage(layer, buf, all_rows)
        self._last_buffer = buf
        # Ping-pong: the next layer goes into the other buffer while this one computes. The copy
        # stream first waits for work already queued on the main stream, which includes the
        # previous layer's reads of that buffer.
        nxt = (layer + 1) % self.num_layers
        if nxt != layer:
            self._stage(nxt, 1 - buf, all_rows)
        self._wait(ready)
        w13, w2 = self._buffers[buf]
        out = fn(x, w13, w2, topk_weights, topk_ids)
        if nxt == layer:
            self._buffer_layer[buf] = None  # one layer only: reload next step
        return out

    def _stage(self, layer: int, buf: int, rows) -> torch.cuda.Event | None:
        self._buffer_layer[buf] = layer
        self._misses += len(rows)
        ready = self._copy(layer, self._buffers[buf], rows)
        self._buffer_ready[buf] = ready
        return ready

    # -- stats --------------------------------------------------------------------------------

    def stats(self, *, sync: bool = True) -> ExpertCacheStats:
        """Counters so far. On CUDA this waits for queued work to read the copy timings.

        ``sync=False``: no CUDA call and no wait, for a thread beside the engine's: the device
        planner's counts as of its last whole step, and the copy times as last folded in."""
        if sync and (self._copy_events or self._wait_events or self._critical_events):
            torch.cuda.synchronize(self.device)
            critical = sum(a.elapsed_time(b) for a, b in self._critical_events) / 1e3
            self._copy_s += sum(a.elapsed_time(b) for a, b in self._copy_events) / 1e3 + critical
            self._exposed_s += sum(a.elapsed_time(b) for a, b in self._wait_events) / 1e3 + critical
            for events in (self._copy_events, self._wait_events, self._critical_events):
                events.clear()
        hits, misses, moved, tokens = self._hits, self._misses, self._bytes, self._tokens_in
        streamed = self._streamed_bytes
        ahead = ahead_used = ahead_wasted = ahead_bytes = wasted_bytes = 0
        device = self._device
        if device is not None:
            for c, lay in zip(device.read_counts(sync=sync), self.store.layers, strict=False):
                hits, misses, tokens = hits + c[0], misses + c[1], tokens + c[2]
                # Misses are copied into a slot or, where none was free, read in place by the
                # kernels; experts loaded ahead were copied too, used or not.
                moved += (c[1] - c[3] + c[4]) * lay.expert_bytes
                streamed += c[3] * lay.expert_bytes
                ahead, ahead_used, ahead_wasted = ahead + c[4], ahead_used + c[5], ahead_wasted + c[6]
                ahead_bytes += c[4] * lay.expert_bytes
                wasted_bytes += c[6] * lay.expert_bytes
        return ExpertCacheStats(
            mode=self.mode,
            gpu_cache_bytes=self.gpu_cache_bytes,
            host_bytes=self.store.host_bytes,
            pinned=self.pinned,
            hits=hits,
            misses=misses,
            bytes_moved=moved,
            tokens=tokens // self.num_layers,
            copy_time_s=self._copy_s,
            exposed_time_s=self._exposed_s,
            timed=(self.measure or not self._cuda) and not self._untimed_calls,
            streamed_layers=self._streamed_calls,
            streamed_bytes=streamed,
            ahead_experts=ahead,
            ahead_used=ahead_used,
            ahead_wasted=ahead_wasted,
            ahead_bytes=ahead_bytes,
            ahead_wasted_bytes=wasted_bytes,
        )

    def reset_stats(self) -> None:
        self.stats()
        if self._device is not None:
            self._device.reset_counts()
        self._hits = self._misses = self._bytes = self._tokens_in = 0
        self._untimed_calls = 0
        self._streamed_calls = self._streamed_bytes = 0
        self._copy_s = self._exposed_s = 0.0
