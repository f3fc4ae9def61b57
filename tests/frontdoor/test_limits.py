"""Per-key limits counted with a clock the tests move: minute windows, requests in flight, budgets."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manager.frontdoor.limits import KeyLimits, Limited, Limiter, duration, period_end, period_start

T0 = datetime(2026, 3, 31, 23, 59, 0, tzinfo=UTC).timestamp()


def nothing_used(key_id: int, since: float) -> int:
    return 0


def test_rpm_refuses_the_third_request_of_a_minute_until_the_window_ends():
    limiter = Limiter(nothing_used)
    limits = KeyLimits(rpm=2)
    first = limiter.admit(1, "app", limits, 1, T0)
    assert first["x-ratelimit-limit-requests"] == "2" and first["x-ratelimit-remaining-requests"] == "1"
    assert limiter.admit(1, "app", limits, 1, T0 + 10)["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(Limited) as refused:
        limiter.admit(1, "app", limits, 1, T0 + 12.5)
    assert refused.value.limit == "rpm" and "rpm 2" in refused.value.message
    assert refused.value.retry_after_s == 48
    assert refused.value.headers["Retry-After"] == "48"
    assert refused.value.headers["x-ratelimit-reset-requests"] == "48s"
    assert refused.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert limiter.admit(1, "app", limits, 1, T0 + 60)["x-ratelimit-remaining-requests"] == "1"


def test_keys_are_counted_apart():
    limiter = Limiter(nothing_used)
    limiter.admit(1, "a", KeyLimits(rpm=1), 1, T0)
    limiter.admit(2, "b", KeyLimits(rpm=1), 1, T0)
    with pytest.raises(Limited):
        limiter.admit(1, "a", KeyLimits(rpm=1), 1, T0)


def test_tpm_counts_the_tokens_answers_used():
    limiter = Limiter(nothing_used)
    limits = KeyLimits(tpm=100)
    limiter.admit(1, "app", limits, 1, T0)
    limiter.ended(1, 60, T0 + 1)
    headers = limiter.admit(1, "app", limits, 1, T0 + 2)
    assert headers["x-ratelimit-remaining-tokens"] == "40" and headers["x-ratelimit-reset-tokens"] == "58s"
    limiter.ended(1, 50, T0 + 3)
    with pytest.raises(Limited) as refused:
        limiter.admit(1, "app", limits, 1, T0 + 4)
    assert refused.value.limit == "tpm" and refused.value.headers["x-ratelimit-remaining-tokens"] == "0"
    limiter.admit(1, "app", limits, 1, T0 + 61)


def test_max_concurrent_counts_requests_until_they_end():
    limiter = Limiter(nothing_used)
    limits = KeyLimits(max_concurrent=2)
    limiter.admit(1, "app", limits, 1, T0)
    limiter.admit(1, "app", limits, 1, T0)
    with pytest.raises(Limited) as refused:
        limiter.admit(1, "app", limits, 1, T0)
    assert refused.value.limit == "concurrent" and refused.value.retry_after_s == 1
    limiter.ended(1, None, T0 + 1)
    limiter.admit(1, "app", limits, 1, T0 + 1)


def test_a_budget_starts_from_the_stored_usage_and_refuses_what_cannot_fit():
    asked: list[tuple[int, float]] = []

    def stored(key_id: int, since: float) -> int:
        asked.append((key_id, since))
        return 900

    limiter = Limiter(stored)
    limits = KeyLimits(token_budget=1000, budget_period="day")
    with pytest.raises(Limited) as refused:
        limiter.admit(7, "app", limits, 101, T0)
    assert refused.value.limit == "budget" and "100 tokens left" in refused.value.message
    assert refused.value.retry_after_s == 60  # the day ends at midnight, UTC
    limiter.admit(7, "app", limits, 100, T0)
    limiter.ended(7, 100, T0 + 1)
    with pytest.raises(Limited):
        limiter.admit(7, "app", limits, 0, T0 + 2)  # no max_tokens: at least one token
    assert asked == [(7, period_start("day", T0))]  # read once per period
    limiter.admit(7, "app", limits, 100, T0 + 61)  # a new day: read again
    assert asked[-1] == (7, period_start("day", T0 + 61))


def test_periods_are_utc_calendar_days_and_months():
    assert datetime.fromtimestamp(period_start("month", T0), UTC) == datetime(2026, 3, 1, tzinfo=UTC)
    assert datetime.fromtimestamp(period_end("month", T0), UTC) == datetime(2026, 4, 1, tzinfo=UTC)
    december = datetime(2026, 12, 15, tzinfo=UTC).timestamp()
    assert datetime.fromtimestamp(period_end("month", december), UTC) == datetime(2027, 1, 1, tzinfo=UTC)
    assert period_end("day", T0) - period_start("day", T0) == 86400


def test_durations_are_written_as_openai_writes_them():
    assert [duration(s) for s in (0, 0.2, 12, 63, 3605)] == ["0s", "1s", "12s", "1m3s", "1h0m5s"]


@settings(max_examples=200, deadline=None)
@given(
    rpm=st.integers(1, 5),
    steps=st.lists(st.tuples(st.floats(0, 30), st.booleans()), max_size=60),
)
def test_no_window_admits_more_than_rpm(rpm, steps):
    limiter = Limiter(nothing_used)
    now, admitted = T0, []
    for advance, end_one in steps:
        now += advance
        try:
            limiter.admit(1, "app", KeyLimits(rpm=rpm, max_concurrent=3), 1, now)
            admitted.append(now)
        except Limited as exc:
            assert exc.retry_after_s >= 1
        if end_one and admitted:
            limiter.ended(1, 5, now)
    # Fixed windows: at most rpm in any window, so at most 2 * rpm in any 60 s span.
    for at in admitted:
        assert sum(1 for t in admitted if at <= t < at + 60) <= 2 * rpm
