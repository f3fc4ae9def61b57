"""Live metrics as a library: collectors (gpu, host, engine, pools), time series (series, history),
the sampler that ties them together (collector), its fan-out to many readers (broadcast), and the
manager's own Prometheus exposition. No web framework in here; routes only translate."""

from manager.metrics.broadcast import Broadcast
from manager.metrics.collector import MetricsCollector, Snapshot, WorkerInfo, WorkerMetrics
from manager.metrics.exposition import ManagerExposition
from manager.metrics.history import HistoryStore, MetricHistory

__all__ = [
    "Broadcast",
    "HistoryStore",
    "ManagerExposition",
    "MetricHistory",
    "MetricsCollector",
    "Snapshot",
    "WorkerInfo",
    "WorkerMetrics",
]
