"""How long a model just swapped in stays, and when a model counts as idle. Pure.

Two busy models that share a GPU would otherwise swap on every request: each request for the one that
is out evicts the one that is in. A worker swapped in for requests stays for its residency unless it
goes idle, so the two alternate in batches; the residency is the config's ``min_residency_s``, or the
worker's last measured swap-in time plus ``MARGIN_S`` (a model slower to bring in stays longer, so a
swap is never most of its time on the GPU). Past its residency it stays while more requests wait for
it than for the model asking for its room (a swap then makes more of them wait), but never beyond
``HOLD_LIMIT`` times its residency: the asking model's wait stays bounded.
"""

from __future__ import annotations

from manager.placement.snapshot import RunningWorker

MARGIN_S = 5.0
# A client that waits for each answer before it asks again (a chat, a batch loop) leaves the model
# without a request for a moment between its requests: that gap is use, not idleness, or the model
# would be evicted between every two requests of the client it was swapped in for.
RECENT_S = 2.0
# The longest a busy model is kept for its queue, in residencies from its swap-in.
HOLD_LIMIT = 2.0


def residency_of(configured_s: float | None, last_swap_in_s: float | None) -> float:
    """The residency: the configured one (0: off), else the last measured swap-in plus the margin
    (nothing measured: none)."""
    if configured_s is not None:
        return configured_s
    return last_swap_in_s + MARGIN_S if last_swap_in_s is not None else 0.0


def idle(worker: RunningWorker, now: float) -> bool:
    """No request in flight or waiting, and none answered in the last ``RECENT_S``."""
    if worker.in_flight > 0 or worker.waiting > 0:
        return False
    return worker.last_request_at is None or now - worker.last_request_at >= RECENT_S


def residency_left(worker: RunningWorker, now: float, asking: int = 0) -> float:
    """Seconds the worker is still kept from eviction (0: it may go), while it is not idle: its
    residency since it was swapped in, and while more requests wait for it than the ``asking`` ones
    for the model that needs its room, up to ``HOLD_LIMIT`` residencies."""
    if worker.resident_since is None or worker.min_residency_s <= 0 or idle(worker, now):
        return 0.0
    ends = worker.resident_since + worker.min_residency_s
    if held_for_queue(worker, asking):
        ends = worker.resident_since + HOLD_LIMIT * worker.min_residency_s
    return max(0.0, ends - now)


def held_for_queue(worker: RunningWorker, asking: int) -> bool:
    """More requests wait for the worker than ``asking`` wait for the model that needs its room.

    Only its queued requests count, not those in flight: a swap waits for those to be answered
    anyway (the drain), while the queued ones would wait through the swap and the swap back."""
    return worker.waiting > asking
