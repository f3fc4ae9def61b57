"""Which replica of a model a request goes to. Pure.

The one with the fewest requests in flight, ties to the one that has served fewest (so that requests
one after another alternate). A request that names a conversation (its ``user`` field, or else its
opening: the prompt's or the first messages' first characters) goes to the replica that conversation
hashes to (rendezvous hashing: a replica that leaves moves only its own conversations), where the
engine's prefix cache likely still holds it, unless that replica has ``AFFINITY_SLACK`` or more
requests in flight beyond the least loaded: then the least loaded takes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

AFFINITY_SLACK = 4
OPENING_CHARS = 512  # of a conversation's start, enough to tell conversations apart


def affinity_of(payload: Mapping[str, Any]) -> str | None:
    """What keeps a request's conversation on one replica: its ``user``, else its opening; None: nothing."""
    user = payload.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        opening = json.dumps(messages[:2], sort_keys=True, default=str)
    else:
        prompt = payload.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else None
        if prompt is None:
            return None
        opening = prompt if isinstance(prompt, str) else json.dumps(prompt, default=str)
    return "opening:" + opening[:OPENING_CHARS]


def choose(
    ready: Sequence[int],
    in_flight: Mapping[int, int],
    served: Mapping[int, int],
    affinity: str | None = None,
    avoid: Collection[int] = (),
) -> int:
    """The worker id (of ``ready``, not empty) a request goes to. ``avoid``: workers that just failed it,
    passed over while another is ready."""
    assert ready, "choose needs a ready replica"
    candidates = [w for w in ready if w not in avoid] or list(ready)
    least = min(in_flight.get(w, 0) for w in candidates)
    if affinity is not None:
        home = max(candidates, key=lambda w: _score(affinity, w))
        if in_flight.get(home, 0) < least + AFFINITY_SLACK:
            return home
    return min(candidates, key=lambda w: (in_flight.get(w, 0), served.get(w, 0), w))


def _score(affinity: str, worker_id: int) -> bytes:
    return hashlib.blake2b(f"{worker_id}\0{affinity}".encode(), digest_size=8).digest()
