"""`vllm-manager token list|revoke|rotate` and `sessions list|revoke`, run while a manager serves the same
data dir: a revoked or rotated token, and every browser session it logged in, stop working at once."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from manager.app import create_app
from manager.deps import SESSION_COOKIE
from manager.settings import Settings
from tests.cli.test_cli import _run


@pytest.fixture
def data(tmp_path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def manager(data) -> Iterator[TestClient]:
    assert _run(["token", "create", "--name", "first"], data).returncode == 0  # the store exists before the app
    with TestClient(create_app(Settings(data_dir=data, engine_python=sys.executable, api_token=None))) as client:
        yield client


def _token(data: Path, *args: str) -> str:
    made = _run(["token", *args], data)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def _log_in(client: TestClient, token: str) -> str:
    """A browser's session cookie, made with this token."""
    client.cookies.clear()
    assert client.post("/login", data={"token": token}, follow_redirects=False).status_code == 303
    value = client.cookies[SESSION_COOKIE]
    client.cookies.clear()
    return value


def _reads(client: TestClient, cookie: str) -> int:
    client.cookies.clear()
    client.cookies.set(SESSION_COOKIE, cookie)
    status = client.get("/api/models").status_code
    client.cookies.clear()
    return status


def _bearer(client: TestClient, token: str) -> int:
    return client.get("/api/models", headers={"Authorization": f"Bearer {token}"}).status_code


def test_revoking_or_rotating_a_token_ends_the_sessions_it_made(manager, data):
    alice, bob = _token(data, "create", "--name", "alice"), _token(data, "create", "--name", "bob")
    alice_session, bob_session = _log_in(manager, alice), _log_in(manager, bob)
    listed = _run(["token", "list"], data).stdout
    assert re.search(r"^\d+\s+alice\s", listed, re.M) and alice not in listed
    revoked = _run(["token", "revoke", "alice"], data)
    assert revoked.returncode == 0 and "1 browser session ended" in revoked.stdout
    assert _reads(manager, alice_session) == 401 and _bearer(manager, alice) == 401
    assert _reads(manager, bob_session) == 200 and _bearer(manager, bob) == 200

    renewed = _run(["token", "rotate", "bob"], data)
    assert renewed.returncode == 0 and "not shown again" in renewed.stderr
    new_bob = renewed.stdout.strip()
    assert new_bob.startswith("vmt_") and new_bob != bob
    assert _reads(manager, bob_session) == 401 and _bearer(manager, bob) == 401
    assert _bearer(manager, new_bob) == 200
    assert re.search(r"^\d+\s+bob\s", _run(["token", "list"], data).stdout, re.M)

    missing = _run(["token", "revoke", "alice"], data)
    assert missing.returncode == 1 and "no stored token" in missing.stderr


def test_the_last_token_is_kept_unless_the_admin_insists(data):
    _token(data, "create", "--name", "only")
    kept = _run(["token", "revoke", "only"], data)
    assert kept.returncode == 1 and "last stored token" in kept.stderr and "token rotate" in kept.stderr
    assert _run(["token", "revoke", "only", "--last"], data).returncode == 0
    assert "No stored tokens" in _run(["token", "list"], data).stderr


def test_tokens_of_the_same_name_are_named_by_id(data):
    _token(data, "create")
    _token(data, "create")
    both = _run(["token", "revoke", "default"], data)
    assert both.returncode == 1 and "2 tokens are named 'default' (ids 1, 2)" in both.stderr
    assert _run(["token", "revoke", "2"], data).returncode == 0


def test_the_admin_lists_and_ends_browser_sessions(manager, data):
    first_token = _token(data, "rotate", "first")
    one, two, three = (_log_in(manager, first_token) for _ in range(3))
    listed = _run(["sessions", "list"], data).stdout.splitlines()
    assert len(listed) == 3 and all("first" in line and "testclient" in line for line in listed)
    assert one.partition(".")[2] not in "".join(listed)
    newest = listed[0].split()[0]
    assert newest == three.partition(".")[0]
    assert _run(["sessions", "revoke", newest], data).stdout.strip() == "1 browser session ended"
    assert _reads(manager, three) == 401 and _reads(manager, one) == 200
    again = _run(["sessions", "revoke", newest], data)
    assert again.returncode == 1 and f"no browser session with id {newest}" in again.stderr
    assert _run(["sessions", "revoke"], data).returncode == 1
    assert _run(["sessions", "revoke", "--all"], data).stdout.strip() == "2 browser sessions ended"
    assert _reads(manager, one) == 401 and _reads(manager, two) == 401
    assert "No browser sessions" in _run(["sessions", "list"], data).stderr
