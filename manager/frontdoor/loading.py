"""What a request waiting for its model is waiting for, in a few words: the loading progress a streamed
request may ask for (SSE comment lines, ``manager.frontdoor.progress``).

A download has real progress (its bytes). A start or wake has none: its share is the time since it was
decided over the time the model's last start (or wake) took, measured the same way, and stays below
100 % however long it runs; without an earlier measurement only the seconds so far are said. No
number is claimed that is not known.
"""

from __future__ import annotations

from collections.abc import Mapping

from manager.frontdoor.slots import Loading, SwapKind
from manager.supervisor.view import WorkerView
from manager.supervisor.worker_state import State

MOST_PERCENT = 99  # a guess from the last start's time never says done: the first answer does


def line(
    config: str, view: WorkerView | None, load: Loading | None, measured: Mapping[SwapKind, float], now: float
) -> str:
    """'downloading qwen3-30b 42 %', 'loading qwen3-30b 42 %', 'starting qwen3-30b, 12 s', ..."""
    if view is not None and view.state == State.DOWNLOADING:
        return f"downloading {config} {view.download.percent} %" if view.download else f"downloading {config}"
    if load is not None and (view is None or view.id == load.worker_id):
        elapsed = max(0.0, now - load.since)
        last = measured.get(load.kind)
        if last:
            share = min(MOST_PERCENT, int(100 * elapsed / last))
            return f"{'loading' if load.kind == 'cold' else 'waking'} {config} {share} %"
        return f"{'starting' if load.kind == 'cold' else 'waking'} {config}, {elapsed:.0f} s"
    if view is not None and view.state in (State.STARTING, State.WAKING):
        return f"{view.state.value} {config}"
    if view is not None and view.state == State.READY:
        return f"waiting for a turn at {config}"
    return f"waiting for {config}"
