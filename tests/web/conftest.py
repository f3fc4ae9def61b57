"""Fixtures for the dashboard tests: a real manager process on loopback, and Debian's chromium.

Playwright's own browser download does not work here; Debian's ``chromium`` package does
(``apt-get install -y chromium``). Screenshots go to test-artifacts/web/ (gitignored).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.engine import stop_leftover_engines

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveManager:
    """``vllm-manager serve`` in its own process, so a test can kill it and start it again."""

    def __init__(self, data_dir: Path, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.env = env or {}  # more settings, over the ones below
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        env = {
            **os.environ,
            "VLLM_MANAGER_ENGINE_PYTHON": sys.executable,
            "VLLM_MANAGER_WORKER_PORTS": "18200-18299",  # away from a manager on this box
            "VLLM_MANAGER_HEALTH_INTERVAL_S": "1",
            **self.env,
        }
        env.pop("VLLM_MANAGER_API_TOKEN", None)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "manager",
                    "serve",
                    "--port",
                    str(self.port),
                    "--data-dir",
                    str(self.data_dir),
                ],  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the manager exited: see {self.log_path}")
            try:
                if httpx.get(self.url + "/api/metrics", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the manager did not answer in {timeout} s: see {self.log_path}")

    def kill(self) -> None:
        """Gone at once, as a crash or a lost network would look to the browser."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.stop_engines()

    def stop_engines(self) -> None:
        """Engines outlive the manager by design; a failed test must not leave one running."""
        stop_leftover_engines(self.data_dir)


@pytest.fixture
def live_manager(tmp_path) -> Iterator[LiveManager]:
    manager = LiveManager(tmp_path / "data", tmp_path / "manager.log")
    manager.start()
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture(scope="module")
def browser():
    # Per module: Playwright's sync API keeps an event loop running while it is open, which would
    # break asyncio.run() in any test collected after it.
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed: apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.js_errors = errors  # a test asserts the pages ran without script errors
    try:
        yield page
    finally:
        context.close()


@pytest.fixture
def shot(request):
    """shot(page, "step") saves test-artifacts/web/<test>-<step>.png and returns its path."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    def take(page, step: str) -> Path:
        path = ARTIFACTS / f"{request.node.name}-{step}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return take
