"""Container health check: is the manager answering GET /api/health with status "ok"?

Docker runs this inside the container (HEALTHCHECK in docker/Dockerfile and Dockerfile.cpu) and
keeps what it prints in `docker inspect --format '{{json .State.Health}}' <container>`, so every
failure says what was wrong. Standard library only: it must work in any image that has python3.

Environment:
  VLLM_MANAGER_HEALTH_URL     default http://127.0.0.1:7999/api/health
  VLLM_MANAGER_API_TOKEN      sent as a bearer token when set (harmless if the route is public)
  VLLM_MANAGER_API_TOKEN_FILE the same, read from a file (a Docker secret)
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:7999/api/health"
TIMEOUT_S = 4.0


def api_token() -> str | None:
    token = os.environ.get("VLLM_MANAGER_API_TOKEN", "").strip()
    if token:
        return token
    token_file = os.environ.get("VLLM_MANAGER_API_TOKEN_FILE", "").strip()
    if token_file:
        try:
            return Path(token_file).read_text().strip() or None
        except OSError:
            # The manager itself reports an unreadable token file; the probe still tries.
            return None
    return None


def check(url: str, token: str | None) -> tuple[bool, str]:
    """(healthy, one line saying why) for one probe of the health URL."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            body = response.read()
    except urllib.error.HTTPError as err:
        return False, f"{url} answered HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return False, f"{url} did not answer: {reason}"
    try:
        payload = json.loads(body)
    except ValueError:
        return False, f"{url} answered 200 but not with JSON: {body[:80]!r}"
    status = payload.get("status") if isinstance(payload, dict) else None
    if status != "ok":
        return False, f"{url} answered status {status!r}, expected 'ok'"
    return True, f"ok (vllm-manager {payload.get('version', '?')})"


def main() -> int:
    healthy, message = check(os.environ.get("VLLM_MANAGER_HEALTH_URL", DEFAULT_URL), api_token())
    print(message, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
