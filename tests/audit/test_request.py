"""What is kept of a request: a short action name from the route, the field names, the target, and an
error message with every secret the request sent hidden, even where the message quotes it."""

from __future__ import annotations

import json

from manager.audit.request import action_of, fields_of, parse_body, scrub, secrets_in, target_of


def test_actions_are_named_from_the_route():
    assert action_of("POST", "/api/models") == "models.create"
    assert action_of("PUT", "/api/models/{name}") == "models.update"
    assert action_of("DELETE", "/api/models/{name}") == "models.delete"
    assert action_of("POST", "/api/workers/{worker_id}/stop") == "workers.stop"
    assert action_of("POST", "/api/workers/{worker_id}/loras/{name}/load") == "workers.loras.load"
    assert action_of("POST", "/api/import") == "import"
    assert action_of("POST", "/login") == "login"
    assert action_of("POST", "/ui/models/new") == "models.create"
    assert action_of("POST", "/ui/keys/{name}/revoke") == "keys.revoke"
    assert action_of("DELETE", "/api/sessions") == "sessions.delete"


def test_a_message_that_quotes_a_secret_keeps_its_words_not_the_secret():
    body = {
        "name": "m",
        "env": {"CUDA_VISIBLE_DEVICES": "0,1", "HF_TOKEN": "abcd-secret"},
        "extra_args": ["--api-key", "k3y-value", "--hf-token=tok-value", "--max-model-len", "4096"],
        "configs": [{"env": {"WANDB_API_KEY": "wandb-value"}}],
        "token": "form-token",
    }
    found = set(secrets_in(body))
    assert found == {"0,1", "abcd-secret", "k3y-value", "tok-value", "4096", "wandb-value", "form-token"}
    message = "rejected: --api-key 'k3y-value' and HF_TOKEN=abcd-secret, wandb-value; also vmt_0123456789abcdef"
    assert scrub(message, found) == "rejected: --api-key '<hidden>' and HF_TOKEN=<hidden>, <hidden>; also <hidden>"
    assert scrub("send 'Authorization: Bearer <token>'", set()) == "send 'Authorization: Bearer <token>'"
    assert scrub("--api-key abc is refused", set()) == "--api-key <hidden> is refused"
    assert scrub("cannot reach https://user:pw@hub.example/x", set()) == "cannot reach https://<hidden>@hub.example/x"


def test_only_field_names_and_a_target_are_kept_of_a_body():
    data = parse_body(
        json.dumps({"name": "qwen", "env": {"HF_TOKEN": "x"}, "model": "org/q"}).encode(), "application/json"
    )
    assert fields_of(data) == ["env", "model", "name"] and target_of({}, data) == "qwen"
    form = parse_body(b"token=secret-here&next=%2F", "application/x-www-form-urlencoded")
    assert fields_of(form) == ["next", "token"] and target_of({}, form) is None
    assert target_of({"worker_id": 3}, data) == "3"
    assert parse_body(b"\xff{", "application/json") is None and fields_of(None) == []
