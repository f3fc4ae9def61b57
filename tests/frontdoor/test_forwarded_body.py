"""What the engine receives: the client's body, with only the fields the front door changes."""

from __future__ import annotations

import json

import pytest

from manager.frontdoor.errors import BadRequest
from manager.frontdoor.proxy import json_model, with_changes

USAGE = {"stream_options": {"include_usage": True}}


def forwarded(body: bytes, changes: dict) -> bytes:
    payload, _ = json_model(body)
    return with_changes(payload, body, changes)


def test_new_fields_go_in_front_and_the_clients_bytes_pass_as_sent():
    body = b'  {"model": "a", "stream": true,\n "messages": [{"role": "user", "content": "h\\u00e9 \xc3\xa9"}]}'
    sent = forwarded(body, USAGE)
    assert sent.endswith(body[3:])  # the client's own fields, byte for byte (escapes and spacing kept)
    assert json.loads(sent) == {**json.loads(body), **USAGE}


def test_a_changed_field_is_written_once_with_its_new_value():
    body = b'{"model": "alias", "stream": true, "stream_options": {"include_usage": false}}'
    sent = forwarded(body, {"model": "org/model", **USAGE})
    assert json.loads(sent) == {"model": "org/model", "stream": True, "stream_options": {"include_usage": True}}
    assert sent.count(b'"model"') == 1 and sent.count(b'"stream_options"') == 1


def test_nothing_to_change_passes_the_body_as_sent():
    body = b'{"model": "a", "prompt": "x"}'
    assert forwarded(body, {}) is body


def test_a_body_in_utf_16_is_encoded_again_rather_than_spliced():
    body = json.dumps({"model": "a", "stream": True}).encode("utf-16-le")
    assert json.loads(forwarded(body, USAGE)) == {"model": "a", "stream": True, **USAGE}


def test_a_lone_surrogate_escape_passes_on_escaped():
    body = b'{"model": "alias", "prompt": "\\ud800 x"}'
    sent = forwarded(body, {"model": "org/model"})
    assert json.loads(sent) == {"model": "org/model", "prompt": "\ud800 x"}
    added = forwarded(b'{"model": "a", "stream_options": {"\\udfff": 1}}', {"stream_options": {"\udfff": 1}})
    assert json.loads(added)["stream_options"] == {"\udfff": 1}


def test_a_value_too_deep_to_write_again_is_a_bad_request():
    deep: list = []
    for _ in range(100_000):  # deeper than any recursion limit, built without recursing
        deep = [deep]
    with pytest.raises(BadRequest, match="nested too deeply"):
        with_changes({"model": "alias", "prompt": deep}, b"{}", {"model": "org/model"})
    with pytest.raises(BadRequest, match="nested too deeply"):
        with_changes({"model": "a"}, b'{"model": "a"}', {"stream_options": {"x": deep}})
