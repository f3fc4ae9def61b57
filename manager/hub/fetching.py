"""What a worker's start needs from downloads: whether its model must be fetched first, waiting for
it, and how far it has come. The supervisor and the front door depend on this, not on how downloads
run (manager.hub.downloads)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


class FetchFailed(Exception):
    """A download a start waited for did not finish; the message says why (for the worker's reason)."""


@dataclass(frozen=True)
class Progress:
    repo: str
    done_bytes: int
    total_bytes: int
    rate_bps: float | None = None  # bytes per second lately; None until it is known

    @property
    def percent(self) -> int:
        return 100 if self.total_bytes <= 0 else min(100, int(100 * self.done_bytes / self.total_bytes))

    @property
    def eta_s(self) -> float | None:
        if not self.rate_bps or self.rate_bps <= 0:
            return None
        return max(0.0, (self.total_bytes - self.done_bytes) / self.rate_bps)

    def line(self, name: str) -> str:
        """'downloading qwen3-30b: 34 %, about 2 min left'."""
        eta = self.eta_s
        left = "" if eta is None else f", about {about(eta)} left"
        return f"downloading {name}: {self.percent} %{left}"


def about(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


class Fetcher(Protocol):
    def needed(self, model: str, env: Mapping[str, str]) -> bool:
        """Whether ``model`` (a hub id) must be downloaded before an engine with ``env`` can load it
        offline; False for a local folder or a complete snapshot in that engine's cache."""
        ...

    async def fetch(self, model: str, env: Mapping[str, str]) -> None:
        """Download ``model`` into the cache of an engine with ``env``, joining a download of it under
        way; returns when it is complete, raises FetchFailed otherwise. Cancelling the call stops the
        wait, not the download (others may wait on it too)."""
        ...

    def progress(self, model: str, env: Mapping[str, str]) -> Progress | None:
        """How far the download of ``model`` is, or None when none runs."""
        ...
