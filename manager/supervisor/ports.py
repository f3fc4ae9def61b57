"""Worker ports: a free one from the manager's range, and whether a chosen one can be used."""

from __future__ import annotations

import socket
from collections.abc import Iterable

from manager.errors import Conflict


def free_port(port_range: Iterable[int], kept: set[int], range_text: str) -> int:
    """The first port of ``port_range`` that no worker keeps (running or stopped) and nothing else holds."""
    for port in port_range:
        if port not in kept and bindable(port):
            return port
    raise Conflict(f"no free port left in {range_text}; stop or delete a worker first")


def check_port(port: int, in_use: set[int]) -> None:
    """Conflict when another running worker or another program holds ``port``."""
    if port in in_use:
        raise Conflict(f"port {port} is already used by another worker")
    if not bindable(port):
        raise Conflict(f"port {port} is taken by another program on this machine")


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
