"""A worker's buttons: the Switch menu chooses nothing for the user and asks before it switches."""

from __future__ import annotations

import re

from manager.web.render import render


def _buttons(current: str, names: list[str], state: str = "ready") -> str:
    return render("fragments/worker_buttons.html", w_id=3, state=state, current=current, model_names=names)


def test_the_switch_menu_starts_on_no_config_lists_the_others_and_confirms():
    html = _buttons("llama", ["alpha", "llama", "qwen"])
    options = re.findall(r"<option[^>]*>([^<]*)</option>", html)
    assert options == ["switch to…", "alpha", "qwen"]  # not the config it runs now
    assert re.search(r'<option value="" selected disabled>switch to…</option>', html)
    assert 'name="model" aria-label="model config to switch to" required' in html
    assert 'hx-confirm="Switch worker 3 from llama to the chosen config? llama stops first."' in html


def test_switch_is_disabled_when_there_is_no_other_config():
    html = _buttons("llama", ["llama"])
    assert re.search(r'<button type="submit"\s+disabled\s*>Switch</button>', html)
