"""Browser sessions: what the login page gives a browser instead of keeping the API token in it.

A session is a cookie value ``<expires>.<nonce>.<mac>``: the MAC is an HMAC, under a key kept in the
data dir (0600), over the expiry, the nonce and the SHA-256 digest of the token that logged in. The
token itself is never in the cookie, and nothing is stored per session, so sessions survive a restart
of the manager. A session ends at its expiry, when its token no longer exists (deleted, or a changed
VLLM_MANAGER_API_TOKEN), or when the key file is deleted (every session at once).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from manager.settings import make_private

SESSION_LIFETIME_S = 7 * 86400
KEY_BYTES = 32


class BrowserSessions:
    def __init__(self, key: bytes, lifetime_s: int = SESSION_LIFETIME_S) -> None:
        if len(key) < KEY_BYTES:
            raise ValueError(f"a session key needs at least {KEY_BYTES} bytes, got {len(key)}")
        self._key = key
        self.lifetime_s = lifetime_s

    @classmethod
    def from_key_file(cls, path: Path) -> BrowserSessions:
        return cls(load_or_create_key(path))

    def _mac(self, expires: int, nonce: str, token_digest: str) -> str:
        message = f"{expires}.{nonce}.{token_digest}".encode("utf-8", "replace")
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def issue(self, token_digest: str, now: float) -> str:
        """A new session for whoever showed the token with this digest."""
        expires = int(now) + self.lifetime_s
        nonce = secrets.token_urlsafe(16)
        return f"{expires}.{nonce}.{self._mac(expires, nonce, token_digest)}"

    def is_valid(self, value: str, token_digests: Iterable[str], now: float) -> bool:
        """True when the value was issued here, has not expired, and its token still exists."""
        expires = self.expires_at(value)
        if expires is None or expires <= now:
            return False
        _, nonce, mac = value.split(".")
        given = mac.encode("utf-8", "replace")  # compared as bytes: a cookie may hold any character
        return any(hmac.compare_digest(given, self._mac(expires, nonce, digest).encode()) for digest in token_digests)

    @staticmethod
    def expires_at(value: str) -> int | None:
        """The expiry written in a session value (unchecked), or None when it is not one."""
        parts = value.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > 12:
            return None
        return int(parts[0])


def load_or_create_key(path: Path) -> bytes:
    """The key in ``path``, made once (random, mode 0600) when the file is not there.

    OSError when it cannot be read or written; ValueError when the file is too short to be a key.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        make_private(path, 0o600)
        key = path.read_bytes()
        if len(key) < KEY_BYTES:
            raise ValueError(
                f"the session key {path} is shorter than {KEY_BYTES} bytes: delete it and a new one is made "
                "at the next start (every browser then signs in again)"
            ) from None
        return key
    key = secrets.token_bytes(KEY_BYTES)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key)
    return key
