"""The dashboard's panel of models behind /v1, after requests through /v1 to stand-in engines."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from manager.app import create_app
from tests.frontdoor.conftest import two_models

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
PAGE = {"Accept": "text/html"}


def panel_rows(html: str) -> dict[str, dict[str, str]]:
    """Each model's row of the panel: its state and its last swap, as shown."""
    rows = {}
    for model, row in re.findall(r'<tr data-model="([^"]+)">(.*?)</tr>', html, re.S):
        state = re.search(r'data-testid="front-door-state">([^<]*)<', row)
        swap = re.search(r'data-testid="last-swap">(.*?)</td>', row, re.S)
        cells = re.findall(r'<td class="num">(\d+)</td>', row)
        rows[model] = {
            "state": state.group(1) if state else "",
            "last swap": re.sub(r"<[^>]+>", "", swap.group(1)).strip() if swap else "",
            "in flight": cells[0],
            "queued": cells[1],
        }
    return rows


def test_the_overview_shows_each_model_with_its_state_and_last_swap(door):
    before = panel_rows(door.get("/", headers=PAGE).text)
    assert before["a"]["state"] == "stopped" and before["a"]["last swap"] == "none yet"
    assert door.post("/v1/chat/completions", json={"model": "alpha", **CHAT}).status_code == 200

    page = door.get("/", headers=PAGE).text
    assert 'hx-get="/ui/front-door"' in page  # it keeps itself up to date
    rows = panel_rows(page)
    assert rows["a"]["state"] == "ready" and (rows["a"]["in flight"], rows["a"]["queued"]) == ("0", "0")
    assert re.fullmatch(r"started cold \d+ s ago in \d+\.\d s", rows["a"]["last swap"]), rows["a"]
    assert rows["b"] == {"state": "stopped", "last swap": "none yet", "in flight": "0", "queued": "0"}
    assert panel_rows(door.get("/ui/front-door").text) == rows


def test_a_woken_model_shows_its_wake(door_settings):
    with TestClient(create_app(door_settings)) as client:
        two_models(client, a={"sleep_level": 2})
        for model in ("a", "b"):
            assert client.post("/v1/chat/completions", json={"model": model, **CHAT}).status_code == 200
        rows = panel_rows(client.get("/ui/front-door").text)
        assert rows["a"]["state"] == "sleeping" and rows["b"]["state"] == "ready"
        assert client.post("/v1/chat/completions", json={"model": "a", **CHAT}).status_code == 200
        rows = panel_rows(client.get("/ui/front-door").text)
        assert rows["a"]["state"] == "ready" and rows["b"]["state"] == "stopped"
        assert re.fullmatch(r"woke \d+ s ago in \d+\.\d s", rows["a"]["last swap"]), rows["a"]
