"""How long the GPU expert planner's warm-up takes in a fresh process, size by size (a GPU check).

    source bench/gpu/env.sh && python3 bench/gpu/planner_warm_up.py   # run it twice: cold, then cached

Prints the seconds of each batch size's first plan (compile or cache load) and of a second plan."""

import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from engine_patches.moe.device_slots import DeviceSlotTables
from engine_patches.moe.sizing import warm_up_tokens

policy = sys.argv[1] if len(sys.argv) > 1 else "frequency"
t0 = time.perf_counter()
tables = DeviceSlotTables(1, 128, 32, "cuda", policy=policy)  # type: ignore[arg-type]
torch.cuda.synchronize()
print(f"tables: {time.perf_counter() - t0:.2f} s (triton: {tables.use_triton})")
for tokens in warm_up_tokens(64, 8):
    ids = (torch.arange(tokens * 8, device="cuda", dtype=torch.int32) % 128).reshape(tokens, 8)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        tables.plan(0, ids, overflow=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    print(f"{tokens:3d} tokens: first {times[0]:.3f} s, then {times[1] * 1e3:.2f} ms")
print(f"total {time.perf_counter() - t0:.1f} s; TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR')}")
