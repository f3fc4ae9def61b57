"""Where the manager listens by default, and which hosts are this machine only: read by the settings
and by the command line, which must not load the settings' machinery to print its help."""

from __future__ import annotations

import ipaddress

DEFAULT_PORT = 7999


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname other than localhost may resolve anywhere: treat as public
