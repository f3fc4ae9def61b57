"""The Jinja2 environment and the filters the templates use to show values.

Every filter takes ``None`` and shows "n/a": a value a GPU or an engine does not report is
not a zero, and must never raise while a page renders.
"""

from __future__ import annotations

import shlex
from functools import lru_cache
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

from manager.web.paths import templates_dir

NA = "n/a"


def nbytes(value: float | None) -> str:
    if value is None:
        return NA
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return NA  # unreachable: the loop returns at TiB


def num(value: float | None, digits: int = 1, unit: str = "") -> str:
    if value is None:
        return NA
    text = f"{value:,.{digits}f}"
    return f"{text} {unit}".rstrip() if unit else text


def pct(value: float | None, digits: int = 0) -> str:
    return NA if value is None else f"{value:.{digits}f} %"


def share(part: float | None, whole: float | None) -> float | None:
    """Part of a whole in percent, for bars; None when either is unknown."""
    if part is None or not whole:
        return None
    return max(0.0, min(100.0, 100.0 * part / whole))


def seconds(value: float | None) -> str:
    """A duration as a user reads it: 42 s, 3 min 5 s, 2 h 10 min, 3 d 4 h."""
    if value is None:
        return NA
    s = int(value)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def took(value: float | None) -> str:
    """How long something took: 0.4 s, 1.8 s, 2 min 5 s."""
    if value is None:
        return NA
    return f"{value:.1f} s" if value < 60 else seconds(value)


def latency(value: float | None) -> str:
    if value is None:
        return NA
    return f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"


@lru_cache(maxsize=1)
def environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(str(templates_dir())),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(nbytes=nbytes, num=num, pct=pct, seconds=seconds, took=took, latency=latency, shell=shlex.join)
    env.globals.update(share=share, NA=NA)
    return env


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)
