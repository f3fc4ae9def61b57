"""The dashboard in Debian's chromium without an engine: the no-GPU state, form validation next
to the fields, and the stale marker when the manager goes away, gone once it is back."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser


def test_overview_without_a_gpu_says_so_and_charts_host_ram(live_manager, page, shot):
    page.goto(live_manager.url + "/")
    page.wait_for_function("document.body.dataset.live === 'fresh'", timeout=10_000)
    assert "No NVIDIA GPU detected" in page.inner_text("#gpus")
    page.wait_for_function("document.querySelector('#chart-gpu-memory .chart-empty')?.textContent.length > 0")
    assert "no NVIDIA GPU detected" in page.inner_text("#chart-gpu-memory")
    assert "used of" in page.inner_text("[data-testid=host-ram]")
    # The RAM chart has history to draw and grows by one point per snapshot.
    page.wait_for_function("window.dashboardCharts.ram && window.dashboardCharts.ram.plot", timeout=10_000)
    before = page.evaluate("window.dashboardCharts.ram.data[0].length")
    page.wait_for_function(f"window.dashboardCharts.ram.data[0].length > {before}", timeout=5_000)
    page.click("[data-window='1h']")
    assert page.get_attribute("[data-window='1h']", "aria-pressed") == "true"
    shot(page, "overview")
    assert page.js_errors == []


def test_model_form_shows_the_api_messages_next_to_the_fields(live_manager, page, shot):
    page.goto(live_manager.url + "/models/new")
    page.fill("#f-name", "bad name!")
    page.fill("#f-model", "/models/x")
    page.fill("#f-gpu_memory_utilization", "1.5")
    page.fill("#f-env", "NOT A PAIR")
    page.click("form.config-form button[type=submit]")
    page.locator(".error[data-field=env]").wait_for()
    assert "KEY=VALUE" in page.inner_text(".error[data-field=env]")
    # Fix the env line: the schema's own messages come back on their fields.
    page.fill("#f-env", "VLLM_LOGGING_LEVEL=DEBUG")
    page.click("form.config-form button[type=submit]")
    page.locator(".error[data-field=gpu_memory_utilization]").wait_for()
    assert "less than or equal to 1" in page.inner_text(".error[data-field=gpu_memory_utilization]")
    assert page.locator(".error[data-field=name]").count() == 1
    assert page.input_value("#f-model") == "/models/x"  # what the user typed stays
    shot(page, "errors")
    page.fill("#f-name", "good")
    page.fill("#f-gpu_memory_utilization", "0.5")
    page.click("form.config-form button[type=submit]")
    # A folder this machine does not have is refused on its field, before anything is stored.
    page.locator(".error[data-field=model]").wait_for()
    assert "/models/x does not exist on this machine" in page.inner_text(".error[data-field=model]")
    page.fill("#f-model", "org/x")
    page.click("form.config-form button[type=submit]")
    page.wait_for_url("**/models/good")
    assert page.input_value("#f-env") == "VLLM_LOGGING_LEVEL=DEBUG"
    page.goto(live_manager.url + "/models")
    assert "good" in page.inner_text("[data-testid=model-list]")
    assert page.js_errors == []


def test_page_marks_its_data_stale_when_the_manager_goes_and_recovers(live_manager, page, shot):
    page.goto(live_manager.url + "/")
    page.wait_for_function("document.body.dataset.live === 'fresh'", timeout=10_000)
    live_manager.kill()
    page.wait_for_function("document.body.dataset.live === 'stale'", timeout=10_000)
    assert page.locator("#stale-banner").is_visible()
    assert "stale" in page.inner_text("#stale-banner")
    shot(page, "stale")
    live_manager.start()
    # The page reconnects by itself (no reload) and the marker goes away.
    page.wait_for_function("document.body.dataset.live === 'fresh'", timeout=30_000)
    assert not page.locator("#stale-banner").is_visible()
    shot(page, "recovered")


@pytest.mark.parametrize(
    ("path", "rendered"), [("/docs", ".opblock"), ("/redoc", "[role=menuitem]")], ids=["swagger-ui", "redoc"]
)
def test_api_docs_render_with_no_network_beyond_the_manager(live_manager, page, shot, path, rendered):
    """Swagger UI and ReDoc come from the manager itself: with every other host unreachable (a box
    without internet) the pages still draw the API's operations, and load no script, style, font or
    data from anywhere else (ReDoc's bundle still asks its maker's site for its "powered by" logo)."""
    elsewhere: list[str] = []

    def only_the_manager(route):
        if route.request.url.startswith(live_manager.url):
            route.continue_()
        else:
            if route.request.resource_type != "image":
                elsewhere.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_manager)
    page.goto(live_manager.url + path)
    page.locator(rendered).first.wait_for(timeout=20_000)
    assert "/api/models" in page.inner_text("body")
    shot(page, path.strip("/"))
    assert elsewhere == []
    assert page.js_errors == []
