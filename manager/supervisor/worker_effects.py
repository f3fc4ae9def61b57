"""What the state machine asks the runner to do: launch, stop or end an engine, wait for a download,
put an engine to sleep or wake it, record an event, answer a command with an error, forget a worker.

Each effect that does something answers with an event (named in its docstring) that goes back to
``lifecycle.step``.
"""

from __future__ import annotations

from dataclasses import dataclass

from manager.errors import ManagerError


@dataclass(frozen=True)
class Launch:
    """Prepare the config's command and start it; answers Launched or LaunchRefused, or NeedsDownload
    when its model must be downloaded first."""

    model: str
    reason: str
    force: bool = False
    downloaded: bool = False  # its download has just ended: launch now, whatever the cache says


@dataclass(frozen=True)
class Fetch:
    """Wait for the download of ``repo`` in the background (joining one under way); answers Fetched."""

    repo: str
    since: float


@dataclass(frozen=True)
class StopFetching:
    """Stop waiting for the download (the download itself goes on: others may wait for it too)."""


@dataclass(frozen=True)
class StopGroup:
    """SIGTERM, grace, SIGKILL to the engine's process group; answers GroupStopped."""

    pid: int


@dataclass(frozen=True)
class KillGroup:
    """End a failed engine's group (hung, or too slow to start); answers Killed with the reason."""

    pid: int
    reason: str


@dataclass(frozen=True)
class PutToSleep:
    """POST /sleep?level=N to the engine, then confirm with GET /is_sleeping; answers Slept."""

    level: int


@dataclass(frozen=True)
class WakeUp:
    """POST /wake_up (level 2: reload the weights first), confirm with /is_sleeping; answers Woke."""

    level: int


@dataclass(frozen=True)
class Record:
    kind: str
    message: str
    data: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class Reject:
    """Answer the command that asked with this error."""

    error: ManagerError


@dataclass(frozen=True)
class Forget:
    """Delete the worker; its owner task ends."""


Effect = Launch | Fetch | StopFetching | StopGroup | KillGroup | PutToSleep | WakeUp | Record | Reject | Forget


def record(kind: str, message: str, **data: object) -> Record:
    return Record(kind, message, tuple(data.items()))
