"""The GPUs a box lends the manager, as ``CUDA_VISIBLE_DEVICES`` says where the manager (or a node's
raylet) was started, and how an engine's GPU numbers become the driver's.

Inside such a mask the manager numbers GPUs as CUDA does: ``CUDA_VISIBLE_DEVICES=1`` is one GPU, GPU 0,
which is the driver's GPU 1. Configs, plans and pages use those numbers; an engine is started with the
driver's own (a mask inside the mask would mean nothing to it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "CUDA_VISIBLE_DEVICES"


def visible_devices(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The driver's devices this process may use, in its numbering order; None where no mask is set
    (every GPU). An entry is an index or a ``GPU-``/``MIG-`` UUID; as CUDA does, the list ends at the
    first entry that is neither."""
    raw = (os.environ if environ is None else environ).get(ENV)
    if raw is None:
        return None
    found: list[str] = []
    for part in raw.split(","):
        entry = part.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        found.append(entry)
    return tuple(found)


def on_driver(engine_visible: str, mask: tuple[str, ...] | None) -> str:
    """An engine's ``CUDA_VISIBLE_DEVICES`` in the manager's numbering, as the driver numbers them.

    Raises ValueError for an index the mask does not have."""
    if mask is None:
        return engine_visible
    out: list[str] = []
    for part in engine_visible.split(","):
        entry = part.strip()
        if not entry.isdigit():
            out.append(entry)  # a UUID names one device whatever the numbering
            continue
        index = int(entry)
        if index >= len(mask):
            raise ValueError(
                f"GPU {index} is not one of the {len(mask)} GPU(s) this host lends the manager "
                f"({ENV}={','.join(mask) or '(empty)'})"
            )
        out.append(mask[index])
    return ",".join(out)


def engine_devices(env: Mapping[str, str], mask: tuple[str, ...] | None) -> dict[str, str]:
    """``env`` with its GPUs in the driver's numbering; an engine given no GPUs gets the whole mask, so
    that it never sees GPUs the host does not lend."""
    placed = dict(env)
    if mask is None:
        return placed
    placed[ENV] = on_driver(placed[ENV], mask) if ENV in placed else ",".join(mask)
    return placed
