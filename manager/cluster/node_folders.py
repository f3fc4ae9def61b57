"""Where a worker's files are on another node of the cluster."""

from __future__ import annotations

from pathlib import Path


def node_folders(data_dir: Path, node: str, worker_id: int) -> tuple[Path, Path]:
    """A worker's run folder and log folder on another node: under the same data dir path there."""
    root = data_dir / "nodes" / node
    return root / "run" / f"worker-{worker_id}", root / "logs" / f"worker-{worker_id}"
