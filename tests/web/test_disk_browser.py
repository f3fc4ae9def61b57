"""The Downloads section of the Models on disk page in Debian's chromium, against a manager whose hub is
a TestHub on loopback: a refusal shown in the form, a download started from it whose progress moves
live, cancelled, resumed, done, and the model then in the cache table, all without a reload."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hub.test_downloads import big_safetensors
from tests.support.hub_server import TestHub
from tests.web.conftest import LiveManager

pytestmark = pytest.mark.browser

SLOW = "acme/slow"
MiB = 1024**2


@pytest.fixture
def hub_manager(tmp_path: Path, test_hub: TestHub, tiny_hub_repo: Path) -> Iterator[LiveManager]:
    config = (tiny_hub_repo / "config.json").read_bytes()
    test_hub.add_repo(SLOW, {"config.json": config, "model.safetensors": big_safetensors(32)})
    env = {"HF_ENDPOINT": test_hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache")}
    manager = LiveManager(tmp_path / "data", tmp_path / "manager.log", env=env)
    manager.start()
    try:
        yield manager
    finally:
        test_hub.release()
        manager.stop()


def percent(page) -> int:
    return int(page.inner_text("tr[data-download] [data-testid=percent]").removesuffix(" %"))


def test_a_download_from_the_page_moves_live_cancels_resumes_and_lands_in_the_cache(hub_manager, test_hub, page, shot):
    # About 8 MiB/s, and a stall at 24 of the 32 MiB: the bar moves, then holds until the download is cancelled.
    test_hub.set_faults(SLOW, rate_bytes_per_s=8 * MiB, stall_after_bytes=24 * MiB)
    page.goto(hub_manager.url + "/disk")
    page.wait_for_function("document.body.dataset.live === 'fresh'", timeout=10_000)  # the stream is on
    assert page.locator("[data-testid=no-downloads]").is_visible()

    page.fill("input[name=repo]", "acme/nope")
    page.click("form.download-form button[type=submit]")
    page.locator("[data-testid=download-form-error]").wait_for()
    assert f"no model acme/nope on {test_hub.url}" in page.inner_text("[data-testid=download-form-error]")

    page.fill("input[name=repo]", SLOW)
    page.click("form.download-form button[type=submit]")
    page.locator("[data-testid=download-started]").wait_for()
    assert page.locator("[data-testid=download-form-error]").count() == 0
    page.locator("tr[data-download][data-state=running]").wait_for(timeout=10_000)
    first = percent(page)
    page.wait_for_function(
        f"parseInt(document.querySelector('tr[data-download] [data-testid=percent]').textContent) > {first}",
        timeout=10_000,
    )
    assert test_hub.wait_stalled(10.0)
    assert first < percent(page) < 100
    assert "MiB/s" in page.inner_text("tr[data-download]")
    shot(page, "running")

    page.click("tr[data-download] button:has-text('Cancel')")
    page.locator("tr[data-download][data-state=cancelled]").wait_for(timeout=10_000)
    assert page.inner_text("tr[data-download] [data-testid=download-state]") == "cancelled"
    shot(page, "cancelled")

    test_hub.set_faults(SLOW, rate_bytes_per_s=8 * MiB)  # no stall this time
    test_hub.release()
    page.click("tr[data-download] button:has-text('Resume')")
    page.locator("tr[data-download][data-state=done]").wait_for(timeout=30_000)
    assert percent(page) == 100
    # The list of models above reloads by itself once the download is done.
    row = page.locator(f"#disk-list tr[data-repo='{SLOW}']")
    row.wait_for(timeout=10_000)
    assert "complete" in row.inner_text() and "incomplete" not in row.inner_text()
    # The stream is quiet while nothing moves: that is not stale data.
    page.wait_for_timeout(4500)
    assert page.evaluate("document.body.dataset.live") == "fresh"
    assert not page.locator("#stale-banner").is_visible()
    shot(page, "done")
    assert page.js_errors == []
