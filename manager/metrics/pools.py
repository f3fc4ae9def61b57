"""Pool stats the engine_patches plugin publishes (pinned memory, LoRA pool, expert cache).

Each engine process of a worker writes ``{run_dir}/stats-{pid}.json``; ``engine_patches.stats``
reads them (it needs no torch). Without the plugin, or before a worker publishes anything, the
report says "not available" and why, so the panel can say so instead of showing zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_patches.moe.stats import link_bytes_per_token

# Per-process figures that must not be summed over processes: ratios, flags and speeds.
_NOT_SUMMED = ("rate", "per_token", "pct", "gbps")


@dataclass(frozen=True)
class ProcessPools:
    pid: int
    role: str
    updated_at: float | None
    sections: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class PoolReport:
    """``totals`` holds, per section ("pinned", "lora_pool", "expert_cache", "sleep_pool"), the numeric
    fields summed over the worker's processes (durations, and the expert cache's tokens, which every
    tensor-parallel rank sees: the largest), plus ``hit_rate``, the expert cache's bytes per token and guess hit rate and
    the sleep pool's GB/s recomputed from the sums."""

    available: bool
    reason: str | None = None
    processes: tuple[ProcessPools, ...] = ()
    totals: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def in_use(self) -> dict[str, dict[str, float]]:
        """The sections with anything in them: one that is all zeros is a pool this worker does not have
        (a worker on vLLM's CPU build pins nothing)."""
        return {section: values for section, values in self.totals.items() if any(values.values())}


StatsReader = Callable[[Path], list[dict[str, Any]]]


class PoolsReader:
    """``reader`` is ``engine_patches.stats.read_stats`` or a stand-in; None: no plugin."""

    def __init__(self, reader: StatsReader | None) -> None:
        self._reader = reader

    @classmethod
    def from_plugin(cls) -> PoolsReader:
        try:
            from engine_patches.stats import read_stats
        except ImportError:
            return cls(None)
        return cls(read_stats)

    def sample(self, run_dir: Path | str | None) -> PoolReport:
        if self._reader is None:
            return PoolReport(False, "not available: the engine_patches plugin is not installed")
        if run_dir is None:
            return PoolReport(False, "not available: this worker has no run directory")
        try:
            docs = self._reader(Path(run_dir))
        except Exception as exc:  # a reader bug must not take the dashboard down
            return PoolReport(False, f"not available: reading {run_dir} failed ({exc})")
        processes = tuple(_process(d) for d in docs if isinstance(d, dict))
        if not any(p.sections for p in processes):
            return PoolReport(
                False,
                "not available: no pool stats published yet (is the offload_patches plugin enabled for this worker?)",
                processes,
            )
        return PoolReport(True, None, processes, _totals(processes))


def _process(doc: dict[str, Any]) -> ProcessPools:
    sections = {k: dict(v) for k, v in doc.items() if isinstance(v, dict)}
    updated = doc.get("updated_at")
    return ProcessPools(
        pid=int(doc.get("pid", 0)),
        role=str(doc.get("role", "?")),
        updated_at=float(updated) if isinstance(updated, (int, float)) else None,
        sections=sections,
    )


def _shared_by_ranks(section: str, key: str) -> bool:
    """A figure every engine process of a worker shares rather than adds to: the largest is the
    worker's. Ranks sleep at the same calls side by side (the sleep pool's counts and times), and
    each tensor-parallel rank sees every token and copies over its own link beside the others
    (the expert cache's tokens and times; its bytes and lookups, those made ahead included, add up)."""
    if section == "sleep_pool":
        return not key.endswith("bytes")
    if section == "expert_cache":
        return "bytes" not in key and key not in ("hits", "misses") and not key.startswith("ahead_")
    return False


def _totals(processes: tuple[ProcessPools, ...]) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for proc in processes:
        for section, values in proc.sections.items():
            out = totals.setdefault(section, {})
            for key, value in values.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if any(tag in key for tag in _NOT_SUMMED):
                    continue
                if _shared_by_ranks(section, key):
                    out[key] = max(out.get(key, 0), value)
                    continue
                out[key] = out.get(key, 0) + value
    sleep = totals.get("sleep_pool", {})
    for what in ("sleep", "wake"):
        seconds, moved = sleep.get(f"last_{what}_s"), sleep.get(f"last_{what}_bytes")
        if seconds and moved:
            sleep[f"last_{what}_gbps"] = moved / seconds / 1e9
    cache = totals.get("expert_cache", {})
    if cache.get("tokens"):
        cache["bytes_per_token"] = link_bytes_per_token(
            cache.get("bytes_moved", 0), cache.get("streamed_bytes", 0), cache["tokens"]
        )
    for out in totals.values():
        if "hits" in out and "misses" in out:
            looked_up = out["hits"] + out["misses"]
            out["hit_rate"] = out["hits"] / looked_up if looked_up else 0.0
    if "ahead_used" in cache and "ahead_wasted" in cache:  # the guess's share right, over all ranks
        judged = cache["ahead_used"] + cache["ahead_wasted"]
        cache["ahead_hit_rate"] = cache["ahead_used"] / judged if judged else 0.0
    return totals


def launched_with_sleep_pool(report: PoolReport) -> bool | None:
    """Whether the engine's plugin installed the sleep pool (its published settings); None: unknown."""
    for proc in report.processes:
        settings = proc.sections.get("plugin", {}).get("settings")
        if isinstance(settings, dict) and "sleep_pool" in settings:
            return bool(settings["sleep_pool"])
    return None


def sleep_pool_bytes(report: PoolReport) -> int:
    """Host bytes the engine's sleep pools hold now (all ranks)."""
    return int(report.totals.get("sleep_pool", {}).get("pool_bytes", 0)) if report.available else 0
