"""Per-key limits on /v1: requests and tokens per minute, requests in flight, and a token budget per
UTC day or month. Pure: the clock is passed in, and nothing here reads the store or the network.

The minute limits count in fixed one-minute windows, each opened by the first request after the last
one ended: per key, two counters and the window's start, whatever the limits' size. The budget is
what the key's answers used since its period began; ``Limiter`` asks ``used_since`` (the stored usage)
for it once per key and period, so it survives a restart, and adds each answer's tokens itself after.
Tokens are known only once an answer ends, so the token limits refuse a request when what is left
cannot hold it (the budget: its ``max_tokens``), and charge what it used after.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

WINDOW_S = 60.0
BudgetPeriod = Literal["day", "month"]
Limit = Literal["rpm", "tpm", "concurrent", "budget"]


@dataclass(frozen=True)
class KeyLimits:
    """One key's limits; None: no limit of that kind."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    token_budget: int | None = None
    budget_period: BudgetPeriod = "month"

    def any(self) -> bool:
        return any(v is not None for v in (self.rpm, self.tpm, self.max_concurrent, self.token_budget))


@dataclass
class _KeyState:
    window_start: float = -math.inf
    requests: int = 0
    tokens: int = 0
    in_flight: int = 0
    period_start: float | None = None  # of the budget: None until read
    budget_used: int = 0


class Limited(Exception):
    """A request over one of its key's limits: ``limit`` says which, ``retry_after_s`` when to try again."""

    def __init__(self, limit: Limit, message: str, retry_after_s: int, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.limit = limit
        self.message = message
        self.retry_after_s = retry_after_s
        self.headers = {**headers, "Retry-After": str(retry_after_s)}


def period_start(period: BudgetPeriod, now: float) -> float:
    """Unix time of the start of the UTC day or month that holds ``now``."""
    at = datetime.fromtimestamp(now, UTC)
    start = at.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        start = start.replace(day=1)
    return start.timestamp()


def period_end(period: BudgetPeriod, now: float) -> float:
    start = datetime.fromtimestamp(period_start(period, now), UTC)
    if period == "day":
        return start.timestamp() + 86400
    month = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return month.timestamp()


def duration(seconds: float) -> str:
    """A wait as OpenAI's x-ratelimit-reset-* headers write it: 0s, 12s, 1m3s, 2h0m5s."""
    whole = max(0, math.ceil(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


class Limiter:
    """Every key's counts, owned by the manager's process (its forwarders ask it over the lease channel)."""

    def __init__(self, used_since: Callable[[int, float], int]) -> None:
        self._used_since = used_since
        self._keys: dict[int, _KeyState] = {}

    def admit(self, key_id: int, name: str, limits: KeyLimits, asked_tokens: int, now: float) -> dict[str, str]:
        """Count a request of this key, or raise Limited. Returns the x-ratelimit headers to answer with."""
        state = self._state(key_id, limits, now)
        if limits.max_concurrent is not None and state.in_flight >= limits.max_concurrent:
            raise Limited(
                "concurrent",
                f"the key {name!r} has {state.in_flight} requests in flight, its limit (max_concurrent "
                f"{limits.max_concurrent}); send the next when one has ended",
                1,
                self.headers(key_id, limits, now),
            )
        window_left = state.window_start + WINDOW_S - now
        if limits.rpm is not None and state.requests >= limits.rpm:
            raise Limited(
                "rpm",
                f"the key {name!r} sent {state.requests} requests this minute, its limit (rpm {limits.rpm}); "
                f"retry in {duration(window_left)}",
                max(1, math.ceil(window_left)),
                self.headers(key_id, limits, now),
            )
        if limits.tpm is not None and state.tokens >= limits.tpm:
            raise Limited(
                "tpm",
                f"the key {name!r} used {state.tokens} tokens this minute, its limit (tpm {limits.tpm}); "
                f"retry in {duration(window_left)}",
                max(1, math.ceil(window_left)),
                self.headers(key_id, limits, now),
            )
        if limits.token_budget is not None:
            left = limits.token_budget - state.budget_used
            wanted = max(1, asked_tokens)
            if wanted > left:
                end = period_end(limits.budget_period, now)
                asked = f"asks for up to {wanted}" if asked_tokens > 1 else "needs at least 1"
                raise Limited(
                    "budget",
                    f"the key {name!r} has {max(0, left)} tokens left of its budget of {limits.token_budget} per "
                    f"{limits.budget_period} (UTC), and this request {asked}; the budget starts again in "
                    f"{duration(end - now)}",
                    max(1, math.ceil(end - now)),
                    self.headers(key_id, limits, now),
                )
        state.requests += 1
        state.in_flight += 1
        return self.headers(key_id, limits, now)

    def ended(self, key_id: int, tokens: int | None, now: float) -> None:
        """A request admitted earlier has ended, having used ``tokens`` (None: not known)."""
        state = self._keys.get(key_id)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        if tokens:
            self.charge(key_id, tokens, now)

    def charge(self, key_id: int, tokens: int, now: float) -> None:
        state = self._keys.get(key_id)
        if state is None:
            return
        if now < state.window_start + WINDOW_S:
            state.tokens += tokens
        state.budget_used += tokens

    def in_flight(self, key_id: int) -> int:
        state = self._keys.get(key_id)
        return 0 if state is None else state.in_flight

    def headers(self, key_id: int, limits: KeyLimits, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit headers for the key's minute limits (those it has)."""
        state = self._keys.get(key_id) or _KeyState()
        open_window = now < state.window_start + WINDOW_S
        reset = duration(state.window_start + WINDOW_S - now) if open_window else "0s"
        out: dict[str, str] = {}
        if limits.rpm is not None:
            used = state.requests if open_window else 0
            out["x-ratelimit-limit-requests"] = str(limits.rpm)
            out["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm - used))
            out["x-ratelimit-reset-requests"] = reset
        if limits.tpm is not None:
            used = state.tokens if open_window else 0
            out["x-ratelimit-limit-tokens"] = str(limits.tpm)
            out["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm - used))
            out["x-ratelimit-reset-tokens"] = reset
        return out

    def _state(self, key_id: int, limits: KeyLimits, now: float) -> _KeyState:
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = _KeyState()
        if now >= state.window_start + WINDOW_S:
            state.window_start, state.requests, state.tokens = now, 0, 0
        if limits.token_budget is not None:
            start = period_start(limits.budget_period, now)
            if state.period_start != start:
                # A key first seen (after a restart too), or in a new period: what the period used is
                # read from the store, once; each answer adds to it from then on.
                state.budget_used = self._used_since(key_id, start)
                state.period_start = start
        return state
