"""The manager's downloads as a start sees them (manager.hub.fetching.Fetcher), for tests of what a start
does around a download: one download, which ends when the test sets ``finish``. How downloads themselves
run is tested on their own."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from manager.hub.fetching import FetchFailed, Progress
from manager.supervisor.supervisor import Supervisor


class Downloads:
    """The manager's downloads as a start sees them: one download, which ends when ``finish`` is set."""

    def __init__(self, missing: bool = True, progress: Progress | None = None) -> None:
        self.missing = missing  # the model is not (complete) in the engine's cache
        self.finish = asyncio.Event()
        self.failure: str | None = None  # the download ends with this FetchFailed
        self.shown = progress or Progress("org/a", 34, 100, rate_bps=1.0)
        self.waits: list[tuple[str, dict[str, str]]] = []
        self.given_up = 0  # waits cancelled

    def needed(self, model: str, env: Mapping[str, str]) -> bool:
        return self.missing

    async def fetch(self, model: str, env: Mapping[str, str]) -> None:
        self.waits.append((model, dict(env)))
        try:
            await self.finish.wait()
        except asyncio.CancelledError:
            self.given_up += 1
            raise
        if self.failure:
            raise FetchFailed(self.failure)
        self.missing = False

    def progress(self, model: str, env: Mapping[str, str]) -> Progress | None:
        return self.shown if self.missing else None


def use_downloads(monkeypatch: pytest.MonkeyPatch, downloads: Downloads) -> Downloads:
    """The manager's starts meet their hub models through ``downloads``."""

    def supervisor(*args: Any, **kwargs: Any) -> Supervisor:
        return Supervisor(*args, **{**kwargs, "fetcher": downloads})

    monkeypatch.setattr("manager.runtime.Supervisor", supervisor)
    return downloads
