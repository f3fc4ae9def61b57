"""Workers: a vLLM server the manager runs (or adopted), remembered across manager restarts."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from manager.schemas.common import utcnow

# A worker stored in one of these states holds no engine, GPUs or config; in any other it holds them, or is
# about to (the supervisor's ``ACTIVE`` states).
ENDED_STATES = ("stopped", "failed")


class Worker(SQLModel, table=True):
    __tablename__ = "worker"
    id: int | None = Field(default=None, primary_key=True)
    model_name: str
    gpus: list[int] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    port: int | None = None
    node: str | None = None  # the Ray node it runs on; None on a single box
    run_dir: str | None = None  # its engine's run folder on that node (None: the local default)
    # What the manager wants: "running" or "stopped". Re-adoption and autostart read it.
    desired: str = "running"
    state: str = "stopped"
    pid: int | None = None
    pid_create_time: float | None = None
    cmdline: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    restart_count: int = 0
    last_error: str | None = None
    # Failed because the live nodes could not hold its start (a crash restart, a roll back, a start after
    # its download): started again when a lost node is back.
    waits_for_node: bool = False
    started_at: datetime | None = None
    created_at: datetime = Field(default_factory=utcnow)
