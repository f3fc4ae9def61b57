"""The Audit page through the real app: linked from the nav, rows of the changes made, filters."""

from __future__ import annotations

import re


def _actions(html: str) -> list[str]:
    rows = re.findall(r'<tr data-audit-id="\d+"[^>]*>(.*?)</tr>', html, re.S)
    return [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)[3] for row in rows]


def test_the_page_lists_the_changes_made_and_filters_them(client):
    client.post("/api/models", json={"name": "a", "model": "org/a", "env": {"HF_TOKEN": "hf_PageSecret123456"}})
    client.delete("/api/models/ghost")
    client.post("/ui/keys", data={"name": "app"})
    page = client.get("/audit")
    assert page.status_code == 200
    assert '<a href="/audit" aria-current="page">Audit</a>' in page.text
    assert _actions(page.text) == ["keys.create", "models.delete", "models.create"]
    assert "DELETE /api/models/{name}" in page.text and "no model config named &#39;ghost&#39;" in page.text
    assert "env, model, name" in page.text and "hf_PageSecret123456" not in page.text
    failed = client.get("/audit", params={"outcome": "failed"})
    assert _actions(failed.text) == ["models.delete"] and 'value="failed" selected' in failed.text
    fragment = client.get("/ui/audit/list", params={"action": "models"})
    assert _actions(fragment.text) == ["models.delete", "models.create"] and "<html" not in fragment.text
    nobody = client.get("/ui/audit/list", params={"who": "token:9"})
    assert "No audit rows match." in nobody.text
    assert 'href="/audit"' in client.get("/keys").text  # every page links it
