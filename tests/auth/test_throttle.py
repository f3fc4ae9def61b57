"""The limit on wrong tokens, on its own, with a clock the test moves."""

from __future__ import annotations

import pytest

from manager.auth.throttle import WrongTokenThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_an_address_waits_once_it_reaches_the_limit_until_its_window_ends(clock):
    throttle = WrongTokenThrottle(limit=3, window_s=60, clock=clock)
    for _ in range(2):
        throttle.record_failure("10.0.0.1")
        assert throttle.retry_after("10.0.0.1") is None
    clock.now += 10
    throttle.record_failure("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 50  # the window began at the first failure
    clock.now += 49.5
    assert throttle.retry_after("10.0.0.1") == 1  # rounded up: never "try again in 0 s"
    clock.now += 0.5
    assert throttle.retry_after("10.0.0.1") is None


def test_failures_from_one_address_do_not_hold_up_another(clock):
    throttle = WrongTokenThrottle(limit=2, window_s=60, clock=clock)
    throttle.record_failure("10.0.0.1")
    throttle.record_failure("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 60
    assert throttle.retry_after("10.0.0.2") is None


def test_failures_older_than_the_window_are_forgotten(clock):
    throttle = WrongTokenThrottle(limit=2, window_s=60, clock=clock)
    throttle.record_failure("10.0.0.1")
    clock.now += 61
    throttle.record_failure("10.0.0.1")  # a new window: one failure in it
    assert throttle.retry_after("10.0.0.1") is None


def test_many_addresses_cannot_grow_it_without_bound(clock):
    throttle = WrongTokenThrottle(limit=2, window_s=60, max_addresses=100, clock=clock)
    throttle.record_failure("10.0.0.1")
    throttle.record_failure("10.0.0.1")
    for n in range(1000):
        clock.now += 0.01
        throttle.record_failure(f"192.168.{n // 256}.{n % 256}")
        assert len(throttle) <= 100
    assert throttle.retry_after("10.0.0.1") is None  # the oldest window went first
    assert throttle.retry_after("192.168.3.231") is None  # one failure: not held up
    throttle.record_failure("192.168.3.231")
    assert throttle.retry_after("192.168.3.231") is not None  # recent ones are still counted


def test_expired_windows_make_room_before_live_ones_go(clock):
    throttle = WrongTokenThrottle(limit=1, window_s=60, max_addresses=2, clock=clock)
    throttle.record_failure("a")
    clock.now += 30
    throttle.record_failure("b")
    clock.now += 31  # a's window has ended, b's has not
    throttle.record_failure("c")
    assert throttle.retry_after("b") == 29 and throttle.retry_after("c") == 60
    assert len(throttle) == 2


@pytest.mark.parametrize("bad", [{"limit": 0}, {"window_s": 0}, {"max_addresses": 0}])
def test_settings_that_would_never_limit_are_refused(bad):
    with pytest.raises(ValueError):
        WrongTokenThrottle(**bad)
