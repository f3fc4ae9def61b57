"""The front door's Prometheus metrics, on the manager's own registry (served at GET /metrics).

``model`` is the model config a request reached (``-`` when its name matched none), so what a client
writes in its requests cannot grow the number of series; ``key`` is an inference key's name (``-``
without one): the admin makes those.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

P = "vllm_manager_proxy_"
UNKNOWN_MODEL = "-"
NO_KEY = "-"
# From a request served at once (sub-millisecond) to a cold start of a big model (minutes).
WAIT_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# The manager's own share of a request: tens of microseconds when all is well, milliseconds when not.
ADDED_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class FrontDoorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            P + "requests",
            "Requests through /v1 by model config and HTTP status.",
            ["model", "code"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            P + "in_flight", "Requests being answered by the model's worker now.", ["model"], registry=self.registry
        )
        self.queue_wait = Histogram(
            P + "queue_wait_seconds",
            "Time a request waited for its model's worker (a start, a swap, a drain) before it was forwarded.",
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.swap = Histogram(
            P + "swap_seconds",
            "Time from deciding to serve a model to its worker being ready, by kind (cold: a process start).",
            ["kind"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )

        self.added_latency = Histogram(
            P + "added_latency_seconds",
            "Time the manager adds to a request on top of the engine: from the route to the request handed "
            "to the engine, and for a whole (not streamed) answer from the engine's end to the client's; "
            "time waiting for the model (queue_wait) is not in it.",
            buckets=ADDED_BUCKETS,
            registry=self.registry,
        )

        self.limited = Counter(
            P + "limited",
            "Requests refused with 429 by their key's limits (rpm, tpm, concurrent, budget) or a full queue.",
            ["key", "limit"],
            registry=self.registry,
        )
        self.tokens = Counter(
            P + "tokens",
            "Tokens the engines' answers say they used, by inference key, model config and kind.",
            ["key", "model", "kind"],
            registry=self.registry,
        )

    def refused_by_limit(self, key: str | None, limit: str) -> None:
        self.limited.labels(key or NO_KEY, limit).inc()

    def used_tokens(self, key: str | None, model: str, prompt: int, completion: int) -> None:
        self.tokens.labels(key or NO_KEY, model, "prompt").inc(prompt)
        self.tokens.labels(key or NO_KEY, model, "completion").inc(completion)

    def answered(self, model: str | None, code: int) -> None:
        self.requests.labels(model or UNKNOWN_MODEL, str(code)).inc()
