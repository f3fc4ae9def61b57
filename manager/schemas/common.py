"""Shared field rules."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

SLUG = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
SLUG_RULE = "1-63 characters: lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_slug(value: str) -> str:
    if not SLUG.match(value):
        raise ValueError(f"must be a slug ({SLUG_RULE}), got {value!r}")
    return value


def expand_home(path: str) -> Path:
    """``Path(path).expanduser()``, where a ``~user`` this machine does not have is a ValueError that
    says what to do (pathlib raises a RuntimeError, which would reach the user as a 500)."""
    try:
        return Path(path).expanduser()
    except RuntimeError as exc:
        raise ValueError(
            "starts with '~' for a home folder this machine does not have (no such user, or no HOME set): "
            "give the full path instead"
        ) from exc


def utcnow() -> datetime:
    return datetime.now(UTC)


MAX_INT = 2**31 - 1
MAX_GIB = 1 << 20  # a mebibyte of GiB: larger than any machine, small enough to stay exact in bytes


def check_numbers(model) -> None:
    """Every number must be finite and of a size a machine can have (SQLite and JSON both care)."""
    import math

    for name, value in model.__dict__.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, float) and (not math.isfinite(value) or abs(value) > MAX_GIB):
            raise ValueError(f"{name} must be a finite number up to {MAX_GIB}, got {value}")
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise ValueError(f"{name} must be at most {MAX_INT}, got {value}")
