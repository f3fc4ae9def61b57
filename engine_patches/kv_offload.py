"""Honest checks around CPU KV offload; plain Python (no torch, no vllm).

The CPU tier of vLLM's KV offload holds prefix-cache blocks. It does not let one request grow
past the GPU KV cache: the scheduler allocates GPU blocks for a request's whole context and copies
CPU hits back into them. So the GPU check stays as vLLM does it; what changes is the message when
it fails, which states both tiers and what would actually help.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class KVTiers:
    """What one engine's two KV tiers hold, in bytes and tokens."""

    max_model_len: int
    needed_bytes: int  # GPU KV bytes one request of max_model_len needs
    gpu_available_bytes: int  # GPU bytes left for the KV cache
    gpu_tokens: int  # the longest request the GPU KV cache can hold
    cpu_bytes: int | None  # the CPU tier's size, None when offload is not configured
    cpu_tokens: int | None  # how many tokens of prefix cache that is
    kv_cache_dtype: str = "auto"


def two_tier_message(t: KVTiers) -> str:
    """The error shown when the GPU KV cache cannot hold one max-length request."""
    lines = [
        f"The GPU KV cache cannot hold one request of max_model_len={t.max_model_len} tokens: "
        f"that needs {_gib(t.needed_bytes)} of KV cache and {_gib(t.gpu_available_bytes)} is "
        f"available on the GPU, room for about {t.gpu_tokens} tokens.",
    ]
    if t.cpu_bytes is not None:
        cpu_tokens = f"about {t.cpu_tokens} tokens" if t.cpu_tokens else "an unknown number of tokens"
        lines.append(
            f"CPU KV offload is configured with {_gib(t.cpu_bytes)} ({cpu_tokens} of prefix "
            f"cache). The CPU tier does not raise max_model_len: a running request's whole KV "
            f"cache must sit on the GPU, and the CPU tier only keeps cached prefixes that are "
            f"copied back into GPU blocks."
        )
    fixes = []
    if t.gpu_tokens > 0:
        fixes.append(f"a lower --max-model-len (at most {t.gpu_tokens})")
    if "fp8" not in t.kv_cache_dtype:
        fixes.append("--kv-cache-dtype fp8 (half the KV bytes per token of a 16-bit cache)")
    fixes.append(
        "more GPU memory for the KV cache: put weights or MoE experts in host memory "
        "(--cpu-offload-gb, --cpu-offload-params experts, or the offload profile's MoE "
        "offload), or raise --gpu-memory-utilization"
    )
    lines.append("What would fit it: " + "; ".join(fixes) + ".")
    return " ".join(lines)


def cpu_bytes_for_blocks(num_cpu_blocks: int, worker_bytes_per_block: int, copies: int) -> int:
    """The ``cpu_bytes_to_use`` that holds ``num_cpu_blocks`` GPU-sized blocks.

    ``worker_bytes_per_block`` is one worker's KV bytes per block (all its layers); the CPU region
    keeps one copy per worker unless the layout is replicated.
    """
    if num_cpu_blocks <= 0:
        raise ValueError(f"num_cpu_blocks must be positive, got {num_cpu_blocks}")
    return num_cpu_blocks * worker_bytes_per_block * max(copies, 1)


# -- headroom for the offload region -----------------------------------------------------------


@dataclass(frozen=True)
class CgroupMemory:
    limit: int
    usage: int
    reclaimable: int  # inactive page cache the kernel can drop before it kills anything

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.usage + self.reclaimable)


def read_cgroup_memory(root: str | os.PathLike[str] = "/sys/fs/cgroup") -> CgroupMemory | None:
    """This process's cgroup memory limit and use (v2, else v1); None without a limit."""
    root = Path(root)
    v2 = root / "memory.max"
    if v2.exists():
        limit_text = _read(v2)
        if limit_text in (None, "max"):
            return None
        usage = _read_int(root / "memory.current")
        stat = _read_stat(root / "memory.stat")
        reclaim = stat.get("inactive_file", 0)
    else:
        limit = _read_int(root / "memory" / "memory.limit_in_bytes")
        if limit is None or limit >= 1 << 60:  # v1 writes a huge number for "no limit"
            return None
        limit_text = str(limit)
        usage = _read_int(root / "memory" / "memory.usage_in_bytes")
        reclaim = _read_stat(root / "memory" / "memory.stat").get("total_inactive_file", 0)
    if usage is None:
        return None
    return CgroupMemory(limit=int(limit_text), usage=usage, reclaimable=reclaim)


def stale_offload_files(shm_path: str | os.PathLike[str] = "/dev/shm") -> list[tuple[str, int]]:
    """vLLM's offload files in ``shm_path``; ones no engine uses are leftovers of a SIGKILL."""
    folder = Path(shm_path)
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("vllm_offload_*.mmap")):
        try:
            found.append((str(path), path.stat().st_size))
        except OSError:
            continue
    return found


class OffloadRegionError(RuntimeError):
    """The CPU KV offload region would not fit in /dev/shm or the cgroup's memory."""


def check_offload_region(
    required: int,
    *,
    shm_path: str | os.PathLike[str] = "/dev/shm",
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
) -> None:
    """Raise ``OffloadRegionError`` naming the size asked and the size available."""
    problems = []
    if os.path.isdir(shm_path):
        free = shutil.disk_usage(shm_path).free
        if required > free:
            problems.append(f"{shm_path} has {_gib(free)} free (raise it with docker's --shm-size or use --ipc=host)")
    cgroup = read_cgroup_memory(cgroup_root)
    if cgroup is not None and required > cgroup.headroom:
        problems.append(
            f"the container's memory limit leaves {_gib(cgroup.headroom)} "
            f"(limit {_gib(cgroup.limit)}, in use {_gib(cgroup.usage)}); /dev/shm pages count "
            f"against it"
        )
    if not problems:
        return
    message = (
        f"The CPU KV offload region needs {_gib(required)} of shared memory, but "
        + "; and ".join(problems)
        + ". Lower the offload size (--kv-offloading-size, or cpu_bytes_to_use)"
    )
    stale = stale_offload_files(shm_path)
    if stale:
        total = sum(size for _, size in stale)
        message += (
            f", or remove offload files left by engines that were killed ({len(stale)} in "
            f"{shm_path}, {_gib(total)}, e.g. {stale[0][0]}) if no engine is using them"
        )
    raise OffloadRegionError(message + ".")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _read_stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out
