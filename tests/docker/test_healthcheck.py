"""docker/healthcheck.py against a real HTTP server standing in for the manager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.docker.conftest import DOCKER

SCRIPT = DOCKER / "healthcheck.py"


class FakeManager:
    """Answers GET /api/health with a configurable status code and body; records headers."""

    def __init__(self) -> None:
        self.status = 200
        self.body = b'{"status": "ok", "version": "0.1.0"}'
        self.seen_headers: list[dict[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                fake.seen_headers.append(dict(self.headers))
                code = fake.status if self.path == "/api/health" else 404
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(fake.body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/api/health"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def fake_manager() -> Iterator[FakeManager]:
    fake = FakeManager()
    yield fake
    fake.server.shutdown()


def probe(url: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MANAGER_")}
    return subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**clean, "VLLM_MANAGER_HEALTH_URL": url, **env},
    )


def test_a_healthy_manager_passes_and_its_version_is_logged(fake_manager):
    result = probe(fake_manager.url)
    assert result.returncode == 0
    assert "0.1.0" in result.stdout


def test_an_error_status_fails_with_the_code_in_the_log(fake_manager):
    fake_manager.status = 503
    result = probe(fake_manager.url)
    assert result.returncode == 1
    assert "503" in result.stderr


def test_a_status_other_than_ok_fails(fake_manager):
    fake_manager.body = json.dumps({"status": "degraded"}).encode()
    result = probe(fake_manager.url)
    assert result.returncode == 1
    assert "degraded" in result.stderr


def test_a_body_that_is_not_json_fails(fake_manager):
    fake_manager.body = b"<html>proxy error</html>"
    result = probe(fake_manager.url)
    assert result.returncode == 1
    assert "not with JSON" in result.stderr


def test_nothing_listening_fails_quickly_with_a_reason(fake_manager):
    url = fake_manager.url
    fake_manager.server.shutdown()
    fake_manager.server.server_close()
    result = probe(url)
    assert result.returncode == 1
    assert "did not answer" in result.stderr


def test_the_token_from_the_secret_file_is_sent(fake_manager, tmp_path):
    secret = tmp_path / "api_token"
    secret.write_text("s3cret-token\n")
    assert probe(fake_manager.url, VLLM_MANAGER_API_TOKEN_FILE=str(secret)).returncode == 0
    assert fake_manager.seen_headers[-1]["Authorization"] == "Bearer s3cret-token"


def test_the_token_from_the_environment_wins_over_the_file(fake_manager, tmp_path):
    secret = tmp_path / "api_token"
    secret.write_text("from-file")
    probe(fake_manager.url, VLLM_MANAGER_API_TOKEN="from-env", VLLM_MANAGER_API_TOKEN_FILE=str(secret))
    assert fake_manager.seen_headers[-1]["Authorization"] == "Bearer from-env"


def test_without_a_token_no_authorization_header_is_sent(fake_manager):
    assert probe(fake_manager.url).returncode == 0
    assert "Authorization" not in fake_manager.seen_headers[-1]
