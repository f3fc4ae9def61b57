"""What the API and the Nodes page show of each node: its state, GPUs, RAM, /dev/shm and workers."""

from __future__ import annotations

import socket
from datetime import UTC, datetime

from pydantic import BaseModel, Field

from manager.metrics.gpu import GpuReport
from manager.metrics.host import HostSample


class NodeGpu(BaseModel):
    index: int
    name: str | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_pct: float | None


class NodeView(BaseModel):
    name: str = Field(description="What a model config's node names it by: its label, else its hostname")
    node_id: str | None = Field(description="Its Ray node id (none without a cluster)")
    hostname: str
    address: str = Field(description="The address its engines listen on")
    state: str = Field(description="alive, or lost (Ray says it is dead, or its agent stopped answering)")
    here: bool = Field(description="The node the manager runs on")
    since: datetime | None = Field(description="When it entered its state, as this manager saw it")
    error: str | None = Field(description="Why its last reading failed")
    gpus_available: bool
    gpus_reason: str | None = Field(description="Why there are no GPU figures")
    gpus: list[NodeGpu]
    cpu_pct: float | None
    ram_total_bytes: int | None
    ram_available_bytes: int | None
    shm_free_bytes: int | None
    workers: list[int] = Field(description="Ids of the workers whose engine runs there")
    spanned_by: dict[int, int] = Field(
        default_factory=dict,
        description="Workers whose model vLLM's Ray executor spreads over several nodes, with the GPUs each "
        "reserved on this node",
    )


def gpus_of(report: GpuReport | None) -> tuple[bool, str | None, list[NodeGpu]]:
    if report is None:
        return False, "no reading yet", []
    gpus = [
        NodeGpu(
            index=g.index,
            name=g.name,
            memory_used_bytes=g.memory_used_bytes,
            memory_total_bytes=g.memory_total_bytes,
            utilization_pct=g.utilization_pct,
        )
        for g in report.gpus
    ]
    return report.available, report.reason, gpus


def node_view(
    *,
    name: str,
    node_id: str | None,
    hostname: str,
    address: str,
    state: str,
    here: bool,
    since: float | None,
    error: str | None,
    host: HostSample | None,
    gpu: GpuReport | None,
    workers: list[int],
    spanned_by: dict[int, int] | None = None,
) -> NodeView:
    available, reason, gpus = gpus_of(gpu)
    return NodeView(
        name=name,
        node_id=node_id,
        hostname=hostname,
        address=address,
        state=state,
        here=here,
        since=datetime.fromtimestamp(since, UTC) if since else None,
        error=error,
        gpus_available=available,
        gpus_reason=reason,
        gpus=gpus,
        cpu_pct=host.cpu_pct if host else None,
        ram_total_bytes=host.ram_total_bytes if host else None,
        ram_available_bytes=host.ram_available_bytes if host else None,
        shm_free_bytes=host.shm.free_bytes if host and host.shm else None,
        workers=workers,
        spanned_by=spanned_by or {},
    )


def this_box(host: HostSample | None, gpu: GpuReport | None, workers: list[int]) -> NodeView:
    """Without a cluster the manager's box is the only node."""
    name = socket.gethostname()
    return node_view(
        name=name,
        node_id=None,
        hostname=name,
        address="127.0.0.1",
        state="alive",
        here=True,
        since=None,
        error=None,
        host=host,
        gpu=gpu,
        workers=workers,
    )
