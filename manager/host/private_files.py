"""Files only the manager's user may read: an engine's log holds whatever it prints (a token in a
traceback, a URL with its password)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def open_private(path: Path, flags: int = os.O_WRONLY | os.O_TRUNC) -> BinaryIO:
    """``path`` opened for writing (``flags``), created if need be, and readable by its owner only
    (also when it existed with a wider mode)."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab" if flags & os.O_APPEND else "wb")
