"""Shared field rules."""

from __future__ import annotations

import re
from datetime import UTC, datetime

SLUG = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
SLUG_RULE = "1-63 characters: lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_slug(value: str) -> str:
    if not SLUG.match(value):
        raise ValueError(f"must be a slug ({SLUG_RULE}), got {value!r}")
    return value


def utcnow() -> datetime:
    return datetime.now(UTC)
