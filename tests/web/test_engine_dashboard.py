"""The whole loop in a browser: create a model config, start a worker with the page's button, see
it turn ready, send it completions, see tokens/s move on the card and the chart, stop it."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.support.engine import tiny_config

pytestmark = [pytest.mark.engine, pytest.mark.browser]

READY_TIMEOUT_MS = 300_000


def _keep_completing(port: int, stop: threading.Event, done: list[int]) -> None:
    """Completions back to back, so the 1 s samples see tokens flowing for several seconds."""
    while not stop.is_set():
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={
                "model": "tiny",
                "prompt": "hello world the model",
                "max_tokens": 48,
                "ignore_eos": True,
            },  # fmt: skip
            timeout=120,
        )
        resp.raise_for_status()
        done.append(resp.json()["usage"]["completion_tokens"])


def test_start_serve_and_stop_a_worker_from_the_dashboard(live_manager, page, shot, tiny_llama, engine_slot):
    # A model config through the Models page form; the command preview shows what will run.
    page.goto(live_manager.url + "/models/new")
    page.fill("#f-name", "tiny")
    page.fill("#f-model", str(tiny_llama))
    page.fill("#f-gpu_memory_utilization", "0.2")
    page.fill("#f-max_model_len", "1024")
    page.fill("#f-start_timeout_s", "240")
    page.fill("#f-extra_args", "--load-format dummy")
    page.click("form.config-form button[type=submit]")
    page.wait_for_url("**/models/tiny")
    page.locator("[data-testid=argv]").wait_for()
    assert "--load-format dummy" in page.inner_text("[data-testid=argv]")
    shot(page, "1-model-config")

    # Start it with the overview's button and watch the card go starting -> ready.
    page.goto(live_manager.url + "/")
    page.select_option("#start-model", "tiny")
    page.click("#start-worker")
    card = page.locator(".worker-card[data-worker='1']")
    state = card.locator("[data-testid=state]")
    state.wait_for(timeout=10_000)
    assert state.text_content() in ("starting", "ready")
    shot(page, "2-starting")
    page.wait_for_function(
        "document.querySelector(\".worker-card[data-worker='1'] [data-testid=state]\")?.textContent === 'ready'",
        timeout=READY_TIMEOUT_MS,
    )
    assert card.locator("button", has_text="Stop").is_enabled()
    port = httpx.get(live_manager.url + "/api/workers/1").json()["port"]
    assert f"{port}" in card.inner_text()

    # Requests flow: the card's tokens/s and the tokens/s chart both show it.
    stop, done = threading.Event(), []
    sender = threading.Thread(target=_keep_completing, args=(port, stop, done), daemon=True)
    sender.start()
    try:
        page.wait_for_function(
            "(() => { const t = document.querySelector(\".worker-card[data-worker='1'] "
            "[data-testid=tps]\"); return t && parseFloat(t.textContent.replace(/,/g, '')) > 0; })()",
            timeout=60_000,
        )
        page.wait_for_function(
            "(() => { const c = window.dashboardCharts.tokens; if (!c || !c.data) return false;"
            " return c.data.slice(1).some(col => col.some(v => v > 0)); })()",
            timeout=60_000,
        )
        shot(page, "3-serving")
    finally:
        stop.set()
        sender.join(130)
    assert done and all(n == 48 for n in done)
    assert page.locator("#chart-tokens .plot canvas").count() == 1

    # The worker page shows the engine's own numbers and the log.
    page.goto(live_manager.url + "/workers/1")
    page.wait_for_function("document.querySelector('[data-testid=engine-tps]') !== null", timeout=15_000)
    page.wait_for_function("document.getElementById('log').textContent.length > 0", timeout=15_000)
    shot(page, "4-worker-page")

    # Stop it with the card's button.
    page.goto(live_manager.url + "/")
    card.locator("button", has_text="Stop").click()
    page.wait_for_function(
        "document.querySelector(\".worker-card[data-worker='1'] [data-testid=state]\")?.textContent === 'stopped'",
        timeout=60_000,
    )
    shot(page, "5-stopped")
    assert httpx.get(live_manager.url + "/api/workers/1").json()["state"] == "stopped"
    assert page.js_errors == []


def test_a_failed_start_shows_vllms_own_reason_on_its_card_and_its_page(
    live_manager, page, shot, tiny_llama, engine_slot
):
    """vLLM refuses a context longer than the model's: the card and the worker page say so in vLLM's
    words, not as "Engine core initialization failed"."""
    body = tiny_config("too-long", tiny_llama, max_model_len=100000)
    assert httpx.post(live_manager.url + "/api/models", json=body).status_code == 201
    wid = httpx.post(live_manager.url + "/api/workers", json={"model": "too-long"}).json()["id"]
    page.goto(live_manager.url + "/")
    reason = page.locator(f".worker-card[data-worker='{wid}'] [data-testid=reason]")
    reason.wait_for(timeout=READY_TIMEOUT_MS)
    assert "max_model_len" in reason.inner_text() and "100000" in reason.inner_text()
    assert page.text_content(f".worker-card[data-worker='{wid}'] [data-testid=state]") == "failed"
    # The table of models behind /v1 and the recent events agree with the card.
    page.wait_for_function(
        "document.querySelector('[data-model=\"too-long\"] [data-testid=front-door-state]')?.textContent === 'failed'",
        timeout=15_000,
    )
    page.locator(".events", has_text="100000").first.wait_for(timeout=15_000)
    shot(page, "overview")
    page.goto(f"{live_manager.url}/workers/{wid}")
    head = page.locator(".worker-head [data-testid=reason]")
    head.wait_for(timeout=15_000)
    assert (head.text_content() or "").strip().startswith("Failed: ") and "100000" in head.inner_text()
    shot(page, "worker-page")
    assert page.js_errors == []
