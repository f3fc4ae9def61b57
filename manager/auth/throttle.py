"""The limit on wrong tokens: an address that sent too many in a while must wait.

Once an address has sent ``limit`` wrong tokens within ``window_s`` of its first one, every request
from it that brings a token (a bearer header, the login form) is refused until that window ends,
even one with the right token: otherwise a guesser could keep guessing and only learn later which
guess was right. Memory stays bounded: at most ``max_addresses`` are remembered, the oldest windows
are forgotten first.

Admin tokens and inference keys are counted apart (one limit each, ``KINDS``): a client that keeps
sending a revoked key must not lock the admin out of the API from the same address, and guesses at
the admin token count together wherever they are sent (/api, /login or /v1).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

ADMIN_TOKEN = "admin token"
INFERENCE_KEY = "inference key"
KINDS = (ADMIN_TOKEN, INFERENCE_KEY)
WRONG = {ADMIN_TOKEN: "wrong tokens", INFERENCE_KEY: "wrong inference keys"}  # in messages


@dataclass
class _Window:
    started: float
    failures: int


class WrongTokenThrottle:
    def __init__(
        self,
        limit: int = 10,
        window_s: float = 300.0,
        max_addresses: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 1 or window_s <= 0 or max_addresses < 1:
            raise ValueError("limit, window_s and max_addresses must be positive")
        self.limit = limit
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._clock = clock
        self._windows: OrderedDict[str, _Window] = OrderedDict()  # oldest window first
        # Told (address, seconds it must wait) when an address reaches the limit: the forwarder
        # processes keep no count of their own (manager.frontdoor.lease_channel).
        self.on_limit: list[Callable[[str, int], None]] = []

    def __len__(self) -> int:
        return len(self._windows)

    def _current(self, address: str, now: float) -> _Window | None:
        window = self._windows.get(address)
        if window is not None and now - window.started >= self.window_s:
            del self._windows[address]
            return None
        return window

    def retry_after(self, address: str) -> int | None:
        """Whole seconds this address must wait before its next token is looked at; None when it need not."""
        now = self._clock()
        window = self._current(address, now)
        if window is None or window.failures < self.limit:
            return None
        return max(1, math.ceil(window.started + self.window_s - now))

    def record_failure(self, address: str) -> None:
        now = self._clock()
        window = self._current(address, now)
        if window is not None:
            window.failures += 1
        else:
            self._make_room(now)
            window = self._windows[address] = _Window(started=now, failures=1)
        if window.failures == self.limit:
            wait_s = max(1, math.ceil(window.started + self.window_s - now))
            for listener in self.on_limit:
                listener(address, wait_s)

    def _make_room(self, now: float) -> None:
        while self._windows:
            _, oldest = next(iter(self._windows.items()))
            if now - oldest.started < self.window_s and len(self._windows) < self.max_addresses:
                return
            self._windows.popitem(last=False)
