"""Fixtures for the dashboard tests: a real manager process on loopback, and Debian's chromium.

Playwright's own browser download does not work here; Debian's ``chromium`` package does
(``apt-get install -y chromium``). Screenshots go to test-artifacts/web/ (gitignored).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.live_manager import LiveManager

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"


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
