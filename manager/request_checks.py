"""What every request to the manager is checked for before it is served, /v1 and the manager's API alike:
who sent it (its address, its bearer secret), whether a page on another site made a browser send it,
and the limit on wrong secrets per address. Plain functions of the request: no FastAPI dependency, no
runtime, so the front door's forwarder processes check a request as the manager's own process does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol
from urllib.parse import urlsplit

from starlette.requests import Request

from manager.auth.throttle import ADMIN_TOKEN, INFERENCE_KEY, WRONG
from manager.errors import Forbidden, TooManyAttempts
from manager.services import inference_keys

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def bearer(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


class Throttle(Protocol):
    """The limit on wrong tokens per address: the manager's ``WrongTokenThrottle``, or a forwarder
    process's view of it (``manager.frontdoor.lease_channel.PushedThrottle``)."""

    def retry_after(self, address: str) -> int | None: ...
    def record_failure(self, address: str) -> None: ...


Throttles = Mapping[str, Throttle]  # one per kind of secret (manager.auth.throttle.KINDS)


def kind_of(secret: str) -> str:
    """Which limit a wrong secret counts against: the inference keys' for one that looks like a key,
    the admin token's for any other (wherever it was sent)."""
    return INFERENCE_KEY if secret.startswith(inference_keys.KEY_START) else ADMIN_TOKEN


def refuse_while_throttled(request: Request, kind: str, throttles: Throttles) -> None:
    """TooManyAttempts when this request's address sent too many wrong secrets of this kind lately."""
    address = client_address(request)
    wait_s = throttles[kind].retry_after(address)
    if wait_s is not None:
        raise TooManyAttempts(f"too many {WRONG[kind]} from {address}: try again in {wait_s} s", retry_after_s=wait_s)


def record_wrong_token(request: Request, kind: str, throttles: Throttles) -> None:
    throttles[kind].record_failure(client_address(request))


DEFAULT_PORTS = {"http": 80, "https": 443}
PROXY_HINT = (
    "; behind a proxy that serves it over https, name the proxy in VLLM_MANAGER_FORWARDED_ALLOW_IPS so that "
    "the manager believes its X-Forwarded-Proto"
)


def _origin(scheme: str, netloc: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) with the scheme's default port filled in; None when it cannot be read."""
    parts = urlsplit(f"//{netloc}")
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    scheme = scheme.lower()
    return scheme, parts.hostname, port or DEFAULT_PORTS.get(scheme, 0)


def own_origin(request: Request) -> str:
    return f"{request.url.scheme}://{request.headers.get('host', '')}"


def is_own_origin(origin: str, request: Request) -> bool:
    """Whether a browser's Origin header names this manager: scheme, host and port all the same."""
    given = urlsplit(origin)
    if given.path or given.query or given.fragment or given.username is not None:
        return False  # an Origin header is scheme://host[:port], nothing more
    mine = _origin(request.url.scheme, request.headers.get("host", ""))
    return mine is not None and _origin(given.scheme, given.netloc) == mine


def refuse_cross_site(request: Request) -> None:
    """A page on another site must not make the user's browser change anything here (CSRF).

    Browsers send Origin (and Sec-Fetch-Site) with their writes; scripts and the CLI send neither.
    """
    if request.method in SAFE_METHODS:
        return
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise Forbidden("cross-site request refused")
    origin = request.headers.get("origin")
    if origin == "null":
        raise Forbidden("request from an opaque origin refused")
    if origin and not is_own_origin(origin, request):
        hint = PROXY_HINT if request.url.scheme == "http" and origin.lower().startswith("https://") else ""
        raise Forbidden(f"request from another origin ({origin}) refused: this manager is {own_origin(request)}{hint}")
