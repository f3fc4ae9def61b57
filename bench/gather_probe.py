"""Probe: how fast can expert-sized pieces of pinned host memory reach the GPU, and how?

The MoE offload's device planner decides on the GPU which experts to fetch, so the copy must be
started by the GPU: a kernel reading pinned host memory in place (zero-copy). Run 5 of
bench/moe_offload.py found that kernel at ~49.5 GB/s against ~55 GB/s for DMA copies. This probe
separates the suspects in one run:

- the host memory: torch ``pin_memory`` (cudaHostAlloc), an mmap registered with cudaHostRegister
  (4 KiB pages: MADV_NOHUGEPAGE) and the same with transparent huge pages (MADV_HUGEPAGE);
- the copier: DMA (async memcpy per expert, issued by the host), the project's Triton gather, a
  CUDA C kernel with 16-byte loads several deep, and Hopper's bulk copy engine (cp.async.bulk,
  host memory -> shared memory -> GPU memory, completing on an mbarrier);
- the shape: 2 and 8 random experts of a Qwen3-30B-A3B layer (w13 6.3 MB + w2 3.1 MB each), and
  one contiguous 1 GiB read as the ceiling.

    python3 bench/gather_probe.py --out $OUT/gather_probe.json     # needs a GPU, CuPy, ~16 GB RAM
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_patches.moe.gather import copy_expert_pairs_indexed, copy_rows_memcpy

H, I = 2048, 768
W13 = 2 * I * H  # elements per expert
W2 = H * I

V4_SRC = r"""
extern "C" __global__ void v4_gather(const unsigned long long* seg_src,
                                     const unsigned long long* seg_dst,
                                     const long long* seg_start, int nseg) {
  const long long total = seg_start[nseg];
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x; base < total;
       base += stride * UNROLL) {
    uint4 v[UNROLL];
    uint4* out[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      long long i = base + k * stride;
      out[k] = 0;
      if (i < total) {
        int s = 0;
        while (s + 1 < nseg && seg_start[s + 1] <= i) ++s;
        long long off = i - seg_start[s];
        v[k] = ((const uint4*)seg_src[s])[off];
        out[k] = ((uint4*)seg_dst[s]) + off;
      }
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k)
      if (out[k]) *out[k] = v[k];
  }
}
"""

BULK_SRC = r"""
#define STAGES 4
extern "C" __global__ void __launch_bounds__(32) bulk_gather(
    const unsigned long long* seg_src, const unsigned long long* seg_dst,
    const long long* seg_bytes, int nseg, unsigned int chunk) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[STAGES];
  if (threadIdx.x != 0) return;
  unsigned bar0 = (unsigned)__cvta_generic_to_shared(bars);
  unsigned buf0 = (unsigned)__cvta_generic_to_shared(smem);
  for (int s = 0; s < STAGES; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar0 + 8 * s));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  // Units: (segment, chunk) in order; this block takes every gridDim.x-th one.
  long long total = 0;
  for (int s = 0; s < nseg; ++s) total += (seg_bytes[s] + chunk - 1) / chunk;
  long long mine = total > blockIdx.x ? (total - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  auto locate = [&](long long j, unsigned long long& src, unsigned long long& dst, unsigned& n) {
    long long u = blockIdx.x + j * gridDim.x;
    int s = 0;
    long long c;
    while (true) {
      c = (seg_bytes[s] + chunk - 1) / chunk;
      if (u < c) break;
      u -= c; ++s;
    }
    long long off = u * chunk;
    long long left = seg_bytes[s] - off;
    n = (unsigned)(left < chunk ? left : chunk);
    src = seg_src[s] + off;
    dst = seg_dst[s] + off;
  };
  auto issue = [&](long long j) {
    unsigned long long src, dst; unsigned n;
    locate(j, src, dst, n);
    int st = j % STAGES;
    unsigned bar = bar0 + 8 * st, buf = buf0 + st * chunk;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(buf), "l"(src), "r"(n), "r"(bar) : "memory");
  };
  for (long long j = 0; j < mine && j < STAGES; ++j) issue(j);
  for (long long j = 0; j < mine; ++j) {
    int st = j % STAGES;
    unsigned bar = bar0 + 8 * st, buf = buf0 + st * chunk;
    unsigned parity = (unsigned)((j / STAGES) & 1);
    asm volatile("{\n .reg .pred P1;\n WAIT:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 " @!P1 bra WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
    unsigned long long src, dst; unsigned n;
    locate(j, src, dst, n);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(buf), "r"(n) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (j + STAGES < mine) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      issue(j + STAGES);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def thp_state() -> dict:
    out = {}
    for name in ("enabled", "defrag"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError as exc:
            out[name] = f"unreadable: {exc}"
    return out


def anon_huge_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


KEEP: list = []  # mmaps stay alive for the whole run


def mmap_registered(nbytes: int, advice: int | None) -> torch.Tensor:
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if advice is not None:
        mm.madvise(advice)
    arr = np.frombuffer(mm, dtype=np.uint8)
    t = torch.from_numpy(arr)
    t.view(torch.int64).random_()  # touch every page with data (never time on zeros)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0x3)
    rc = int(getattr(err, "value", err))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")
    KEEP.append((mm, arr))
    return t


def torch_pinned(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t.view(torch.int64).random_()
    return t


def as_store(raw: torch.Tensor, n_experts: int):
    w13 = raw[: n_experts * W13 * 2].view(torch.bfloat16).view(n_experts, W13)
    w2 = raw[n_experts * W13 * 2 : n_experts * (W13 + W2) * 2].view(torch.bfloat16).view(n_experts, W2)
    return w13, w2


def same_bits(gpu: torch.Tensor, host: torch.Tensor) -> bool:
    """Bitwise equality: the random words include NaN patterns, which never compare equal."""
    return torch.equal(gpu.cpu().view(torch.int16), host.view(torch.int16))


def timed(fn, sets, reps=5) -> float:
    """Median seconds per call over ``reps`` passes through all ``sets``."""
    fn(sets[0])
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for s in sets:
            fn(s)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(sets))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--experts", type=int, default=400, help="experts per host store")
    ap.add_argument("--sets", type=int, default=24)
    args = ap.parse_args(argv)
    import cupy as cp

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = np.random.default_rng(7)
    n = args.experts
    nbytes = n * (W13 + W2) * 2
    result: dict = {"thp": thp_state(), "sms": sms, "rows": []}
    print("THP:", result["thp"], flush=True)

    v4 = {u: cp.RawKernel(V4_SRC.replace("UNROLL", str(u)), "v4_gather", options=("-std=c++17",)) for u in (1, 4, 8)}
    try:
        bulk = cp.RawKernel(BULK_SRC, "bulk_gather", options=("-std=c++17", "-arch=sm_90"))
        bulk.max_dynamic_shared_size_bytes = 4 * 32768
    except Exception as exc:
        bulk = None
        print("bulk kernel unavailable:", exc, flush=True)

    slots = 32
    d13 = torch.empty(slots, W13, dtype=torch.bfloat16, device=dev)
    d2 = torch.empty(slots, W2, dtype=torch.bfloat16, device=dev)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)

    sources = {}
    before = anon_huge_kib()
    sources["torch pin_memory"] = torch_pinned(nbytes)
    sources["mmap 4K + register"] = mmap_registered(nbytes, getattr(mmap, "MADV_NOHUGEPAGE", None))
    mid = anon_huge_kib()
    sources["mmap THP + register"] = mmap_registered(nbytes, getattr(mmap, "MADV_HUGEPAGE", None))
    after = anon_huge_kib()
    result["anon_huge_kib"] = {"before": before, "after_4k": mid, "after_thp": after}
    print("AnonHugePages KiB:", result["anon_huge_kib"], flush=True)

    def rows_for(k):
        out = []
        for _ in range(args.sets):
            e = gen.choice(n, size=k, replace=False)
            s = gen.choice(slots, size=k, replace=False)
            out.append((e.tolist(), s.tolist()))
        return out

    def record(src, what, k, sec, nbytes_moved, **extra):
        gbs = nbytes_moved / sec / 1e9
        row = {"source": src, "copier": what, "experts": k, "us": sec * 1e6, "GB/s": gbs, **extra}
        result["rows"].append(row)
        print(f"{src:22s} {what:34s} {k!s:>6} {sec * 1e6:9.1f} us {gbs:6.1f} GB/s", flush=True)

    for name, raw in sources.items():
        w13, w2 = as_store(raw, n)

        def check(label, copy, st):
            """Poison the slots, run one copy, compare every copied expert bit for bit."""
            d13.fill_(0)
            d2.fill_(0)
            copy()
            torch.cuda.synchronize()
            e, s = st
            ok = all(same_bits(d13[s[i]], w13[e[i]]) and same_bits(d2[s[i]], w2[e[i]]) for i in range(len(e)))
            result.setdefault("exact", {})[f"{name} {label}"] = ok
            print(f"  {label} copy exact:", ok, flush=True)

        for k in (2, 8):
            sets = rows_for(k)
            moved = k * (W13 + W2) * 2
            dev_sets = [(torch.tensor(e, device=dev), torch.tensor(s, device=dev)) for e, s in sets]

            def dma(st):
                copy_rows_memcpy(w13, d13, st[0], st[1])
                copy_rows_memcpy(w2, d2, st[0], st[1])

            record(name, "DMA memcpy per expert", k, timed(dma, sets), moved)

            def tri(st):
                copy_expert_pairs_indexed((w13, w2), (d13, d2), st[0], st[1])

            record(name, "Triton gather (default)", k, timed(tri, dev_sets), moved)
            if k == 2:  # check the copy byte for byte once per source
                check("triton", lambda: tri(dev_sets[0]), sets[0])

            seg_sets = []
            for e, s in sets:
                srcs, dsts, sizes = [], [], []
                for ei, si in zip(e, s, strict=False):
                    for src_t, dst_t, words in ((w13, d13, W13), (w2, d2, W2)):
                        srcs.append(src_t[ei].data_ptr())
                        dsts.append(dst_t[si].data_ptr())
                        sizes.append(words * 2)
                seg_sets.append((srcs, dsts, sizes))

            def v4_args(ss):
                srcs, dsts, sizes = ss
                start = np.concatenate([[0], np.cumsum(np.array(sizes) // 16)]).astype(np.int64)
                return (
                    cp.asarray(np.array(srcs, dtype=np.uint64)),
                    cp.asarray(np.array(dsts, dtype=np.uint64)),
                    cp.asarray(start),
                    np.int32(len(srcs)),
                )

            v4_sets = [v4_args(ss) for ss in seg_sets]
            for u, kern in v4.items():
                for blocks in (sms * 4, sms * 16):

                    def run_v4(a, kern=kern, blocks=blocks):
                        kern((blocks,), (256,), a)

                    record(name, f"CUDA 16B loads x{u}, {blocks} blocks", k, timed(run_v4, v4_sets), moved)
            if bulk is not None:
                bulk_sets = [
                    (
                        cp.asarray(np.array(ss[0], dtype=np.uint64)),
                        cp.asarray(np.array(ss[1], dtype=np.uint64)),
                        cp.asarray(np.array(ss[2], dtype=np.int64)),
                        np.int32(len(ss[0])),
                    )
                    for ss in seg_sets
                ]
                for chunk in (16384, 32768):
                    for blocks in (sms, sms * 2):

                        def run_bulk(a, chunk=chunk, blocks=blocks):
                            bulk((blocks,), (32,), a + (np.uint32(chunk),), shared_mem=4 * chunk)

                        try:
                            sec = timed(run_bulk, bulk_sets)
                        except Exception as exc:
                            print("  bulk failed:", exc, flush=True)
                            break
                        record(name, f"bulk copy {chunk // 1024}K x4, {blocks} blocks", k, sec, moved)
                if k == 2:
                    check("bulk", lambda: run_bulk(bulk_sets[0]), sets[0])
        # contiguous 1 GiB: the ceiling per source
        whole = raw[: 1 << 30]
        record(name, "DMA 1 GiB", "1GiB", timed(lambda _: big.copy_(whole, non_blocking=True), [0]), 1 << 30)
        a = (
            cp.asarray(np.array([whole.data_ptr()], dtype=np.uint64)),
            cp.asarray(np.array([big.data_ptr()], dtype=np.uint64)),
            cp.asarray(np.array([0, (1 << 30) // 16], dtype=np.int64)),
            np.int32(1),
        )
        record(name, "CUDA 16B loads x4 1 GiB", "1GiB", timed(lambda _: v4[4]((sms * 16,), (256,), a), [0]), 1 << 30)
        if bulk is not None:
            ab = (a[0], a[1], cp.asarray(np.array([1 << 30], dtype=np.int64)), np.int32(1), np.uint32(32768))
            try:
                record(
                    name,
                    "bulk copy 32K 1 GiB",
                    "1GiB",
                    timed(lambda _: bulk((sms * 2,), (32,), ab, shared_mem=4 * 32768), [0]),
                    1 << 30,
                )
            except Exception as exc:
                print("  bulk 1 GiB failed:", exc, flush=True)

    # Which load width the Triton gather compiled to.
    try:
        from engine_patches.moe.gather import _gather_pairs_kernel

        e0, s0 = torch.tensor([1, 2], device=dev), torch.tensor([3, 4], device=dev)
        w13, w2 = as_store(sources["torch pin_memory"], n)
        ck = _gather_pairs_kernel[(4,)](
            w13.view(torch.int64),
            d13.view(torch.int64),
            w2.view(torch.int64),
            d2.view(torch.int64),
            e0,
            s0,
            2,
            W13 // 4,
            W2 // 4,
            BLOCK=4096,
            BP=2,
        )
        ptx = ck.asm["ptx"]
        result["triton_loads"] = {
            w: ptx.count(w) for w in ("ld.global.v2.b64", "ld.global.v4.b32", "ld.global.b64", "ld.global.v2.b32")
        }
        print("Triton gather loads in PTX:", result["triton_loads"], flush=True)
    except Exception as exc:
        print("could not read the Triton PTX:", exc, flush=True)

    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
