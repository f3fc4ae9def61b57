"""Checks of the exact-size pinned allocator that need a real CUDA device (run with the bench).

Prints one JSON document; exits 1 if a check failed. On a machine without CUDA it says so.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from engine_patches.pinned import CudaHostRegistrar, PinnedAllocator


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False}))
        return 0
    checks: dict[str, object] = {}
    observed: dict[str, object] = {}
    alloc = PinnedAllocator(chunk_bytes=1 << 20)  # 1 MiB chunks: many registrations
    t = alloc.empty((64 << 20,), torch.uint8)
    s = alloc.stats()
    checks["chunked_is_pinned"] = bool(t.is_pinned() and t[-1:].is_pinned())
    checks["chunks_for_64MiB"] = s.chunks
    t.fill_(3)
    # Copies that stay inside one chunk work...
    g = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    for start in range(0, 64 << 20, 1 << 20):
        g[start : start + (1 << 20)].copy_(t[start : start + (1 << 20)], non_blocking=True)
    torch.cuda.synchronize()
    checks["per_chunk_copy_correct"] = bool((g == 3).all().item())
    # ...one that spans two registrations is refused by CUDA (recorded, not asserted).
    try:
        t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        observed["span_copy"] = "ok"
    except Exception as exc:
        observed["span_copy"] = f"refused: {str(exc).splitlines()[0]}"
    single = PinnedAllocator().empty((64 << 20,), torch.uint8)
    single.fill_(5)
    checks["single_registration_copy_correct"] = bool((single.to("cuda", non_blocking=True) == 5).all().item())
    del single
    ptr = t.data_ptr()
    del t, g
    gc.collect()
    checks["freed_stats_zero"] = alloc.stats().pinned_bytes == 0 and alloc.stats().chunks == 0
    # After unregistering, the same range can be registered again (it would fail if still pinned)
    # -- the range is unmapped now, so register a fresh mapping of the same size instead.
    checks["re_register_ok"] = alloc.empty((64 << 20,), torch.uint8).is_pinned()
    gc.collect()

    budget = PinnedAllocator(budget_bytes=8 << 20)
    a = budget.empty((6 << 20,), torch.uint8)
    b = budget.empty((6 << 20,), torch.uint8)  # over the 8 MiB budget: pageable
    checks["budget_first_pinned"] = bool(a.is_pinned())
    checks["budget_second_pageable"] = not b.is_pinned()
    checks["budget_fallbacks_counted"] = budget.stats().over_budget == 1
    del a, b

    # Registering a range twice fails in CUDA: the allocator must fall back, not raise.
    reg = CudaHostRegistrar()
    reg.available()
    c = alloc.empty((4 << 20,), torch.uint8)
    code = reg.register(c.data_ptr(), 4 << 20)
    checks["double_register_refused"] = code != 0
    torch.cuda.synchronize()  # the cleared error must not surface in later CUDA calls
    x = torch.ones(10, device="cuda") * 2
    checks["cuda_ok_after_refusal"] = float(x.sum().item()) == 20.0
    del c
    gc.collect()
    ok = all(v is True or (isinstance(v, int) and not isinstance(v, bool)) for v in checks.values())
    print(json.dumps({"cuda": True, "ptr_seen": hex(ptr), "checks": checks, "observed": observed, "ok": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
