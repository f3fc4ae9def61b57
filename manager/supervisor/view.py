"""What the rest of the manager may know about a worker: an immutable view, published by its runner.

The API returns it as is, the pages render it, the metrics and LoRA code read it. Nobody outside
the supervisor holds a runner.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from manager.hub.fetching import Progress, about
from manager.supervisor.worker_state import ACTIVE, State


class DownloadProgress(BaseModel):
    """How far the download of a downloading worker's model is."""

    model_config = ConfigDict(frozen=True)

    repo: str = Field(description="The model's id on the Hugging Face Hub")
    done_bytes: int
    total_bytes: int
    percent: int
    rate_bps: float | None = Field(description="Bytes per second lately; none until it is known")
    eta_s: float | None = Field(description="Seconds left at that rate; none until it is known")

    @classmethod
    def of(cls, progress: Progress) -> DownloadProgress:
        return cls(
            repo=progress.repo,
            done_bytes=progress.done_bytes,
            total_bytes=progress.total_bytes,
            percent=progress.percent,
            rate_bps=progress.rate_bps,
            eta_s=progress.eta_s,
        )

    @property
    def progress(self) -> Progress:
        return Progress(self.repo, self.done_bytes, self.total_bytes, self.rate_bps)

    def state_line(self) -> str:
        """'downloading 34 %, about 2 min left', as a worker's state reads while it downloads."""
        left = "" if self.eta_s is None else f", about {about(self.eta_s)} left"
        return f"downloading {self.percent} %{left}"


class WorkerView(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: int
    model: str = Field(description="The model config the worker runs (or ran last)")
    served_model_name: str | None = Field(description="The name requests use, once a start has prepared it")
    state: State
    detail: str | None = Field(description="What a start is doing now (the engine's latest log line)")
    pid: int | None = Field(description="The engine's process id while it has one")
    port: int | None
    node: str | None = Field(default=None, description="The Ray node it runs on (none: this box, without a cluster)")
    address: str = Field(default="127.0.0.1", description="Where the manager reaches the engine's HTTP server")
    gpus: list[int]
    uptime_s: float | None = Field(description="Seconds since the engine started, while ready")
    restart_count: int = Field(description="Crash restarts in a row (reset after a healthy while)")
    next_restart_in_s: float | None = Field(description="Seconds until the next crash restart, while crashed")
    last_error: str | None
    started_at: datetime | None
    run_dir: str = Field(description="The engine's run folder (offload-pool statistics are written here)")
    log_file: str | None = Field(description="The current start's log file")
    download: DownloadProgress | None = Field(
        default=None, description="How far its model's download is, while downloading (none until it is known)"
    )

    @property
    def ready(self) -> bool:
        return self.state == State.READY

    @property
    def active(self) -> bool:
        """Holds (or is about to hold) its engine, its GPUs and its config."""
        return self.state in ACTIVE

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)
