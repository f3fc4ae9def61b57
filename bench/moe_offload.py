"""Benchmark: MoE decode with experts in host memory (engine_patches.moe) against its limits.

A Qwen3-30B-A3B-shaped stack (48 layers, 128 experts, top-8, hidden 2048, moe_intermediate 768,
bf16) with an attention stand-in (the q/k/v/o projections, no KV read) and realistic routing
(skewed expert popularity per layer, each sequence keeping part of its previous token's experts).
Per batch size it reports tokens/s for: all experts resident on the GPU (upper bound), copy-all
(every expert copied each step, with ping-pong), and the LRU cache at several budgets, plus the link bound: the
bytes the cache really missed over the pinned host-to-GPU bandwidth measured in the same run.

    python bench/moe_offload.py --out results.json            # full run (needs a GPU, ~60 GB RAM)
    python bench/moe_offload.py --smoke                        # tiny sizes on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_layer_parts import FETCH_CONFIGS, fetch_sweep, replay_seconds, use_fetch_config

from engine_patches.moe.device_slots import DeviceSlotTables
from engine_patches.moe.experts import auto_experts, looped_experts, reference_moe
from engine_patches.moe.gather import copy_expert_pairs_indexed, copy_experts, copy_experts_indexed
from engine_patches.moe.offload import ExpertOffload
from engine_patches.moe.sizing import slots_for_budget
from engine_patches.moe.store import ExpertStore

REGISTERED: set[int] = set()


def registered_host_empty(shape, dtype):
    """Exact-size pinned memory: a plain allocation registered with cudaHostRegister."""
    t = torch.empty(shape, dtype=dtype)
    if torch.cuda.is_available():
        try:
            rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
        except Exception as exc:  # binding missing in this torch build
            rc = repr(exc)
        if rc != 0:
            print(f"cudaHostRegister failed ({rc}); falling back to pin_memory()", flush=True)
            t = t.pin_memory()
        else:
            REGISTERED.add(t.data_ptr())
    return t


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bandwidth(device, nbytes) -> float:
    """Host-to-GPU GB/s of one large pinned copy, median of 5."""
    src = registered_host_empty((nbytes,), torch.uint8)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    if src.data_ptr() in REGISTERED:
        # A registered range must be unregistered before it is freed: a later registration of
        # the reused address would fail with "resource already mapped".
        torch.cuda.cudart().cudaHostUnregister(src.data_ptr())
        REGISTERED.discard(src.data_ptr())
    return nbytes / statistics.median(times[1:]) / 1e9


def make_trace(gen, steps, layers, batch, experts, top_k, alpha, reuse):
    """Expert ids [steps, layers, batch, top_k]: Zipf(alpha) popularity per layer, and each
    sequence keeps each of its previous token's experts with probability ``reuse``."""
    ids = torch.empty(steps, layers, batch, top_k, dtype=torch.long)
    for layer in range(layers):
        pop = torch.empty(experts)
        pop[torch.randperm(experts, generator=gen)] = 1.0 / torch.arange(1, experts + 1) ** alpha
        prev = torch.multinomial(pop.expand(batch, experts), top_k, generator=gen)
        for step in range(steps):
            keep = torch.rand(batch, top_k, generator=gen) < reuse
            weights = pop.repeat(batch, 1)
            weights.scatter_(1, prev, torch.where(keep, 0.0, pop[prev]))
            new = torch.multinomial(weights, top_k, generator=gen)
            cand = torch.cat([torch.where(keep, prev, -1), new], dim=1)
            order = torch.argsort((cand < 0).int(), dim=1, stable=True)[:, :top_k]
            prev = torch.gather(cand, 1, order)
            ids[step, layer] = prev
    return ids


class Stack:
    """Dense per-layer weights (attention stand-in, router) shared by every variant."""

    def __init__(self, a, device, dtype, gen_device):
        h = a.hidden
        qkv = a.heads * a.head_dim + 2 * a.kv_heads * a.head_dim

        def rnd(*shape):
            return (torch.randn(*shape, device=device, generator=gen_device) / shape[0] ** 0.5).to(dtype)

        self.layers = [(rnd(h, qkv), rnd(a.heads * a.head_dim, h), rnd(h, a.experts)) for _ in range(a.layers)]
        self.q_dim = a.heads * a.head_dim

    def step(self, x, topk_weights, ids, moe):
        """One decode step through every layer; ``moe(layer, h, w, ids)`` runs the experts."""
        for layer, (wqkv, wo, wg) in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],))
            x = x + (h @ wqkv)[:, : self.q_dim] @ wo
            h = F.rms_norm(x, (x.shape[-1],))
            _router_logits = h @ wg  # the router's cost; the ids come from the trace
            x = x + moe(layer, h, topk_weights[layer], ids[layer])
        return x


def time_steps(device, stack, x, tw, trace, moe, warmup, timed):
    for s in range(warmup):
        stack.step(x, tw, trace[s % len(trace)], moe)
    sync(device)
    t0 = time.perf_counter()
    for s in range(warmup, warmup + timed):
        stack.step(x, tw, trace[s % len(trace)], moe)
    sync(device)
    return (time.perf_counter() - t0) / timed


def graph_steps(device, stack, x, tw, trace, moe, warmup, timed, before_timing=None):
    """Capture one whole decode step (every layer) in a CUDA graph; time its replays.

    The step reads its expert ids from a static buffer that each replay refills, so the graph is
    the same work as the eager step with none of the per-kernel launch cost. Returns (step
    seconds, the output of the first timed replay)."""
    ids_buf = trace[0].clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up (compiles the kernels) off the capture stream
        for s in range(warmup):
            ids_buf.copy_(trace[s % len(trace)])
            stack.step(x, tw, ids_buf, moe)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = stack.step(x, tw, ids_buf, moe)
    if before_timing is not None:
        before_timing()
    first = None
    sync(device)
    t0 = time.perf_counter()
    for s in range(warmup, warmup + timed):
        ids_buf.copy_(trace[s % len(trace)])
        graph.replay()
        if first is None:
            first = out.clone()
    sync(device)
    dt = (time.perf_counter() - t0) / timed
    del graph
    return dt, first


def check_device_planner(device, a, steps=40):
    """The Triton slot planner leaves exactly the state and plan the torch planner leaves."""
    g = torch.Generator().manual_seed(5)
    slots = max(a.top_k, a.experts // 4)
    kern = DeviceSlotTables(2, a.experts, slots, device, use_triton=True)
    ref = DeviceSlotTables(2, a.experts, slots, device, use_triton=False)
    for step in range(steps):
        tokens = int(torch.randint(1, slots // a.top_k + 1, (1,), generator=g))
        ids = torch.stack([torch.randperm(a.experts, generator=g)[: a.top_k] for _ in range(tokens)]).to(device)
        p, q = kern.plan(step % 2, ids), ref.plan(step % 2, ids)
        for x, y in (
            (p.slot_ids, q.slot_ids),
            (p.load_experts, q.load_experts),
            (p.load_slots, q.load_slots),
            (kern.expert_slot, ref.expert_slot),
            (kern.last_used, ref.last_used),
            (kern.counts, ref.counts),
        ):
            if not torch.equal(x, y):
                return f"differs at step {step}"
    return "same"


GATHER_CONFIGS = [
    (programs, block, warps) for programs in (0, 264, 132, 66) for block, warps in ((2048, 4), (4096, 4), (8192, 8))
]


def gather_sweep(store, device, configs, n_experts_list, reps=16):
    """GB/s of the device-indexed gathers, timed as CUDA-graph replays (as the step runs them).

    ``pairs p/b/w``: w13 and w2 in one launch with p programs (0: one per chunk), block b words,
    w warps; ``rows``: the previous runs' kernel, one launch per tensor. Each replay copies
    ``reps`` different random expert sets, so nothing is served from a cache."""
    lay = store.layers[0]
    out, g = {}, torch.Generator().manual_seed(4)
    for n in n_experts_list:
        dst = (
            torch.empty((n, *lay.w13.shape[1:]), dtype=lay.w13.dtype, device=device),
            torch.empty((n, *lay.w2.shape[1:]), dtype=lay.w2.dtype, device=device),
        )
        sets = [torch.randperm(lay.num_experts, generator=g)[:n].int().to(device) for _ in range(reps)]
        slots = torch.arange(n, dtype=torch.int32, device=device)
        variants = {
            "rows 8192/8": lambda e: [
                copy_experts_indexed(s_t, d_t, e, slots, block=8192, num_warps=8)
                for s_t, d_t in zip((lay.w13, lay.w2), dst, strict=False)
            ]
        }
        for p_, b_, w_ in configs:
            variants[f"pairs {p_}/{b_}/{w_}"] = lambda e, p_=p_, b_=b_, w_=w_: copy_expert_pairs_indexed(
                (lay.w13, lay.w2), dst, e, slots, programs=p_, block=b_, num_warps=w_
            )
        for name, fn in variants.items():
            try:
                per_set = replay_seconds(lambda i, fn=fn: fn(sets[i]), len(sets))
                e = int(sets[-1][-1])
                assert torch.equal(dst[0][-1].cpu(), lay.w13[e]) and torch.equal(dst[1][-1].cpu(), lay.w2[e]), (
                    f"{name} copied the wrong expert"
                )
                out[f"{name} @{n}"] = n * lay.expert_bytes / per_set / 1e9
            except Exception as exc:  # report, go on with the others
                out[f"{name} @{n}"] = f"failed: {exc!r}"[:200]
    return out


def check_experts_fn(device, dtype, a, experts_fn):
    """The GPU expert math against the float64 reference, on fresh random inputs."""
    g = torch.Generator().manual_seed(11)
    e, h, i = 16, a.hidden, a.inter
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    worst = 0.0
    for tokens in (8, 1, 2):  # 1 and 2: the decode-batch kernels; 8: grouped matmuls
        x = torch.randn(tokens, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[: a.top_k] for _ in range(tokens)])
        ids[0, 0] = -1
        tw = torch.rand(tokens, a.top_k, generator=g)
        ref = reference_moe(x.float(), w13.float(), w2.float(), tw, ids).double()
        got = experts_fn(x.to(device), w13.to(device), w2.to(device), tw.to(device), ids.to(device))
        worst = max(worst, float((got.double().cpu() - ref).norm() / ref.norm()))
    return worst


def check_offload_matches_resident(store, gpu_experts, device, a, method, experts_fn):
    """Cached mode with the smallest cache (rounds, evictions) and copy-all against resident."""
    g = torch.Generator().manual_seed(9)
    worst = 0.0
    # Host planner (8 tokens, top_k slots: rounds and evictions), copy-all, and the device planner
    # (1-2 tokens in 2*top_k slots: evictions) with the host taking over at 8 tokens now and then.
    for mode, planner, slots in (
        ("cached", "host", a.top_k),
        ("copy_all", "auto", None),
        ("cached", "auto", 2 * a.top_k),
    ):
        off = ExpertOffload(
            store,
            device=device,
            mode=mode,
            copy_method=method,
            slots_per_layer=slots,
            experts_fn=experts_fn,
            planner=planner,
        )
        for rnd in range(6 if planner == "auto" else 3):
            tokens = 8 if planner != "auto" or rnd == 3 else 1 + rnd % 2
            for layer in range(min(4, a.layers)):
                ids = torch.stack([torch.randperm(a.experts, generator=g)[: a.top_k] for _ in range(tokens)]).to(device)
                tw = torch.rand(tokens, a.top_k, generator=g).to(device)
                x = torch.randn(tokens, a.hidden, generator=g).to(gpu_experts[0][0].dtype).to(device)
                ref = experts_fn(x, *gpu_experts[layer], tw, ids).float()
                got = off.forward(layer, x, tw, ids).float()
                worst = max(worst, float((got - ref).norm() / ref.norm()))
    return worst


def copy_method_bandwidth(store, device, method, n_experts, repeats=10):
    """GB/s of copying n random experts (w13 + w2) of layer 0 into slots with ``method``."""
    lay = store.layers[0]
    dst13 = torch.empty((n_experts, *lay.w13.shape[1:]), dtype=lay.w13.dtype, device=device)
    dst2 = torch.empty((n_experts, *lay.w2.shape[1:]), dtype=lay.w2.dtype, device=device)
    times, g = [], torch.Generator().manual_seed(3)
    for r in range(repeats + 1):
        ids = torch.randperm(lay.num_experts, generator=g)[:n_experts].tolist()
        slots = list(range(n_experts))
        sync(device)
        t0 = time.perf_counter()
        moved = copy_experts(lay.w13, dst13, ids, slots, method)
        moved += copy_experts(lay.w2, dst2, ids, slots, method)
        sync(device)
        if r:
            times.append(time.perf_counter() - t0)
        if r == repeats:  # the last copy must be right
            assert torch.equal(dst13[-1].cpu(), lay.w13[ids[-1]]) and torch.equal(dst2[0].cpu(), lay.w2[ids[0]]), (
                f"{method} copied the wrong experts"
            )
    return moved / statistics.median(times) / 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU, float32")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[0.10, 0.25, 0.50],
        help="GPU cache budget as a fraction of all expert bytes",
    )
    p.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of expert popularity")
    p.add_argument("--reuse", type=float, default=0.5, help="chance a sequence keeps each expert of its previous token")
    p.add_argument("--warmup", type=int, default=12)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--copy-all-steps", type=int, default=4)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.experts, a.top_k, a.hidden, a.inter = 4, 16, 4, 64, 32
        a.heads, a.kv_heads, a.head_dim, a.batches = 2, 1, 32, [1, 4]
        a.warmup, a.steps, a.copy_all_steps = 3, 4, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res = {"args": vars(a) | {"out": str(a.out)}, "device": str(device), "runs": []}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
    log = print

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    try:
        res["experts_fn_rel_err"] = check_experts_fn(device, dtype, a, auto_experts)
        experts_fn = auto_experts
        assert res["experts_fn_rel_err"] < tol, res["experts_fn_rel_err"]
    except Exception as exc:  # grouped_mm missing or wrong here: use the portable loop, say so
        res["grouped_mm_failed"] = repr(exc)[:300]
        experts_fn = looped_experts
        res["experts_fn_rel_err"] = check_experts_fn(device, dtype, a, looped_experts)
        assert res["experts_fn_rel_err"] < tol
    res["experts_fn"] = experts_fn.__name__
    log(f"expert math ({experts_fn.__name__}) vs float64 reference: rel err {res['experts_fn_rel_err']:.2e}")

    gdev = torch.Generator(device=device).manual_seed(0)
    t0 = time.perf_counter()
    store = ExpertStore(allocator=registered_host_empty)
    gpu_experts = []
    for _ in range(a.layers):
        w13 = (torch.randn(a.experts, 2 * a.inter, a.hidden, device=device, generator=gdev) / a.hidden**0.5).to(dtype)
        w2 = (torch.randn(a.experts, a.hidden, a.inter, device=device, generator=gdev) / a.inter**0.5).to(dtype)
        store.add_layer(w13, w2)
        gpu_experts.append((w13, w2))
    res["store"] = {"host_bytes": store.host_bytes, "pinned": store.pinned, "build_s": time.perf_counter() - t0}
    log(
        f"expert store: {store.host_bytes / 1e9:.2f} GB host, pinned={store.pinned}, "
        f"built in {res['store']['build_s']:.1f} s"
    )
    stack = Stack(a, device, dtype, gdev)
    expert_b = store.layers[0].expert_bytes

    bw = pinned_bandwidth(device, min(1 << 30, store.host_bytes))
    res["pinned_h2d_GBps"] = bw
    res["copy_methods_GBps"] = {}
    for method in ("memcpy", "triton") if device.type == "cuda" else ("memcpy",):
        try:
            res["copy_methods_GBps"][method] = copy_method_bandwidth(store, device, method, a.top_k)
        except Exception as exc:  # report, do not hide
            res["copy_methods_GBps"][method] = f"failed: {exc!r}"[:300]
    log(f"pinned host->GPU {bw:.1f} GB/s; {a.top_k} experts by method: {res['copy_methods_GBps']}")
    res["offload_rel_err"] = {}
    for method in res["copy_methods_GBps"]:
        if isinstance(res["copy_methods_GBps"][method], float):
            try:
                err = check_offload_matches_resident(store, gpu_experts, device, a, method, experts_fn)
            except Exception as exc:  # report and go on to the timings
                err = f"failed: {exc!r}"[:300]
            res["offload_rel_err"][method] = err
            if not (isinstance(err, float) and err < tol):
                log(f"CHECK FAILED: offloaded MoE ({method}) differs from resident: {err}")
    log(f"offloaded vs resident MoE output, rel err: {res['offload_rel_err']}")

    cuda = device.type == "cuda"
    res["gather_GBps"] = {}
    if cuda:  # the device planner's kernels: checked, and the gather's launch shape picked
        try:
            res["device_planner_check"] = check_device_planner(device, a)
        except Exception as exc:  # report; the device variants will fail and say so too
            res["device_planner_check"] = f"failed: {exc!r}"[:300]
        res["gather_GBps"] = gather_sweep(store, device, GATHER_CONFIGS, [2, 8])
        log(
            f"device planner (Triton vs torch): {res['device_planner_check']}; gather GB/s "
            "(graph replays): "
            + ", ".join(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}" for k, v in res["gather_GBps"].items())
        )

    def rate(cfg):  # GB/s for 2 experts, the typical batch-1 miss count per layer
        v = res["gather_GBps"].get(f"pairs {cfg[0]}/{cfg[1]}/{cfg[2]} @2")
        return v if isinstance(v, float) else 0.0

    best = {}  # grid size -> its fastest (programs, block, warps)
    for cfg in GATHER_CONFIGS:
        if cfg[0] not in best or rate(cfg) > rate(best[cfg[0]]):
            best[cfg[0]] = cfg
    top = max(best.values(), key=rate)
    res["gather_best_by_programs"] = {str(k): v for k, v in best.items()}
    res["gather_programs_block_warps"] = top
    log(f"gather picked (programs, block, warps): {top}; best per grid size: {best}")
    if cuda:  # the fetch kernel's launch shapes (2 of 8 experts loading); the runs use the default
        layers = min(8, a.layers)
        slots8 = [
            tuple(torch.empty((a.top_k, *t.shape[1:]), dtype=t.dtype, device=device) for t in (lay.w13, lay.w2))
            for lay in store.layers[:layers]
        ]
        host8 = [(lay.w13, lay.w2) for lay in store.layers[:layers]]
        ids8 = [torch.randperm(a.experts, device=device, generator=gdev)[: a.top_k].view(1, -1) for _ in range(layers)]
        xs = torch.randn(1, a.hidden, device=device, generator=gdev).to(dtype)
        ws = torch.softmax(torch.randn(1, a.top_k, device=device, generator=gdev), -1)
        sweep = fetch_sweep(host8, slots8, xs, ws, ids8, FETCH_CONFIGS, (2,))
        ok = {cfg: sec for (cfg, _), sec in sweep.items() if isinstance(sec, float)}
        res["fetch_us_by_config"] = {
            str(cfg): (sec * 1e6 if isinstance(sec, float) else sec) for (cfg, _), sec in sweep.items()
        }
        use_fetch_config(FETCH_CONFIGS[0])  # the shipped default, whatever was fastest here
        if ok:
            res["fetch_config_fastest"] = min(ok, key=ok.get)
            log(
                "fetch kernel (rows, columns, warps, split w2), us/layer for 2 loading: "
                + ", ".join(f"{c}: {t * 1e6:.1f}" for c, t in ok.items())
                + f"; runs use the default {FETCH_CONFIGS[0]}"
            )
        del slots8

    def record(run, st, timed):
        link_s = st.bytes_moved / timed / (bw * 1e9)
        run |= {
            "link_bound_step_s": link_s,
            "link_bound_tokens_per_s": run["batch"] / link_s if link_s else None,
            "vs_link_bound": run["step_s"] / link_s if link_s else None,
            "stats": st.as_dict(),
        }
        res["runs"].append(run)
        copy = (
            f"copy {st.copy_time_s / timed * 1e3:7.2f} ms/step, exposed {st.exposed_time_s / timed * 1e3:7.2f}"
            if st.timed
            else "copy not timed"
        )
        log(
            f"b={run['batch']:3d} {run['variant']:22s}{run['tokens_per_s']:9.1f} tok/s  "
            f"hit {st.hit_rate:5.1%}  {st.bytes_per_token / 1e6:8.1f} MB/token  link bound "
            f"{run['link_bound_tokens_per_s'] or 0:9.1f} tok/s (x{run['vs_link_bound'] or 0:.2f})  "
            f"{copy}"
        )

    gen = torch.Generator().manual_seed(42)
    for batch in a.batches:
        n_trace = a.warmup + a.steps
        trace = make_trace(gen, n_trace, a.layers, batch, a.experts, a.top_k, a.alpha, a.reuse)
        trace = trace.to(device)
        tw = torch.softmax(torch.randn(a.layers, batch, a.top_k, generator=gen), -1).to(device)
        x = torch.randn(batch, a.hidden, generator=gen).to(dtype).to(device)
        uniq = statistics.mean(len(torch.unique(trace[s, lay])) for s in range(n_trace) for lay in range(a.layers))
        base = {"batch": batch, "unique_experts_per_layer": uniq}

        def resident(layer, h, w, ids):
            return experts_fn(h, gpu_experts[layer][0], gpu_experts[layer][1], w, ids)

        dt = time_steps(device, stack, x, tw, trace, resident, a.warmup, a.steps)
        res["runs"].append(base | {"variant": "resident", "step_s": dt, "tokens_per_s": batch / dt})
        log(f"b={batch:3d} resident              {batch / dt:9.1f} tok/s  (unique experts/layer {uniq:.1f})")
        ref_out = None
        if cuda:  # the same expert math, launched as one CUDA graph per step
            try:
                dt, ref_out = graph_steps(device, stack, x, tw, trace, resident, a.warmup, a.steps)
                res["runs"].append(base | {"variant": "resident_graph", "step_s": dt, "tokens_per_s": batch / dt})
                log(f"b={batch:3d} resident_graph        {batch / dt:9.1f} tok/s")
            except Exception as exc:  # report, go on with the eager figures
                res.setdefault("graph_failed", []).append(f"resident b{batch}: {exc!r}"[:300])
                log(f"graph capture failed (resident b{batch}): {exc!r}"[:300])
        if cuda and batch == 1:  # where a step's time goes: the stand-in alone, + the planner
            tables = DeviceSlotTables(a.layers, a.experts, 32, device)

            def no_experts(layer, h, w, ids):
                return h.new_zeros(h.shape)

            def planner_only(layer, h, w, ids):
                tables.plan(layer, ids)
                return h.new_zeros(h.shape)

            for name, fn in (("no_experts_graph", no_experts), ("planner_only_graph", planner_only)):
                try:
                    dt, _ = graph_steps(device, stack, x, tw, trace, fn, a.warmup, a.steps)
                except Exception as exc:  # report, go on
                    res.setdefault("graph_failed", []).append(f"{name}: {exc!r}"[:300])
                    continue
                res["runs"].append(base | {"variant": name, "step_s": dt, "tokens_per_s": batch / dt})
                log(f"b={batch:3d} {name:22s}{batch / dt:9.1f} tok/s ({dt * 1e3:.2f} ms/step)")

        # (mode, budget, planner, copy method, in a CUDA graph, ExpertOffload options, suffix)
        variants = [("copy_all", None, "auto", "memcpy", False, {}, "")]
        gather_kw = dict(gather_programs=top[0], gather_block=top[1], gather_warps=top[2])
        for f in a.budgets:
            variants.append(("cached", f, "auto", "memcpy", False, {}, ""))
            if batch == 1 and f == 0.25:  # the previous runs' way: every layer planned on the host
                variants.append(("cached", f, "host", "memcpy", False, {}, ""))
                if cuda and isinstance(res["copy_methods_GBps"].get("triton"), float):
                    variants.append(("cached", f, "host", "triton", False, {}, ""))
            if cuda:
                variants.append(("cached", f, "device", "memcpy", True, gather_kw, ""))
                if batch == 1:  # run 5's default (gather, then the expert kernels), and with
                    # the resident experts computed beside the gather
                    variants.append(
                        ("cached", f, "device", "memcpy", True, gather_kw | {"fetch_in_kernel": False}, "_gather")
                    )
                    variants.append(
                        (
                            "cached",
                            f,
                            "device",
                            "memcpy",
                            True,
                            gather_kw | {"fetch_in_kernel": False, "device_overlap": True},
                            "_gather_overlap",
                        )
                    )
        for mode, frac, planner, method, graphed, opts, suffix in variants:
            kw = dict(
                device=device,
                mode=mode,
                copy_method=method,
                experts_fn=experts_fn,
                measure_copy_time=not graphed,
                planner=planner,
                **opts,
            )
            gcfg = (opts.get("gather_programs"), opts.get("gather_block"), opts.get("gather_warps"))
            overlap = opts.get("device_overlap", False)
            if mode == "cached":
                gib = frac * store.host_bytes / 2**30
                kw["slots_per_layer"] = slots_for_budget(
                    gib, num_experts=a.experts, num_layers=a.layers, one_expert_bytes=expert_b, top_k=a.top_k
                )
                if graphed and batch * a.top_k > kw["slots_per_layer"]:
                    continue  # too many experts per batch for the device planner: host path only
            off = ExpertOffload(store, **kw)
            name = mode if mode == "copy_all" else f"cached_{int(frac * 100)}pct"
            if mode == "cached" and planner == "host":
                name += "_host" + ("_triton" if method == "triton" else "")
            elif mode == "cached" and off.plans_on_device(trace[0, 0]):
                name += "_device" + ("_graph" if graphed else "") + suffix
            warm, timed = (1, a.copy_all_steps) if mode == "copy_all" else (a.warmup, a.steps)

            def moe(layer, h, w, ids, _off=off):
                return _off.forward(layer, h, w, ids)

            run = base | {
                "variant": name,
                "copy_method": method,
                "planner": planner,
                "overlap": overlap,
                "gather_programs_block_warps": gcfg,
                "fetch_in_kernel": off.fetch_in_kernel,
                "budget_fraction": frac,
                "slots_per_layer": off.slots_per_layer,
                "gpu_cache_bytes": off.gpu_cache_bytes,
            }
            try:
                if graphed:
                    dt, out = graph_steps(device, stack, x, tw, trace, moe, warm, timed, before_timing=off.reset_stats)
                    if ref_out is not None:  # same ids, same step: the offloaded graph's output
                        run["rel_err_vs_resident_graph"] = float(
                            (out.float() - ref_out.float()).norm() / ref_out.float().norm()
                        )
                else:
                    for s in range(warm):
                        stack.step(x, tw, trace[s % n_trace], moe)
                    off.reset_stats()
                    sync(device)
                    t0 = time.perf_counter()
                    for s in range(warm, warm + timed):
                        stack.step(x, tw, trace[s % n_trace], moe)
                    sync(device)
                    dt = (time.perf_counter() - t0) / timed
            except Exception as exc:  # report, go on with the other variants
                res.setdefault("variant_failed", []).append(f"{name} b{batch}: {exc!r}"[:300])
                log(f"FAILED {name} b{batch}: {exc!r}"[:300])
                continue
            run |= {"step_s": dt, "tokens_per_s": batch / dt}
            record(run, off.stats(), timed)
            del off
            if cuda:
                torch.cuda.empty_cache()

    summary = {}
    for batch in a.batches:
        got = {r["variant"]: r for r in res["runs"] if r["batch"] == batch}
        ca = got.get("copy_all")
        c25 = [r for v, r in got.items() if v.startswith("cached_25pct") and "_host" not in v]
        if ca and c25:
            top = max(c25, key=lambda r: r["tokens_per_s"])
            summary[f"b{batch}_cached25_best_variant"] = top["variant"]
            summary[f"b{batch}_cached25_over_copy_all"] = top["tokens_per_s"] / ca["tokens_per_s"]
            summary[f"b{batch}_cached25_vs_link_bound"] = top["vs_link_bound"]
    res["summary"] = summary
    log("summary: " + json.dumps(summary))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
