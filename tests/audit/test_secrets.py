"""No secret reaches the audit log: not a config's HF_TOKEN or --api-key (made, changed, refused,
exported and imported), not an inference key, not an admin token made, rotated or used to log in."""

from __future__ import annotations

from typer.testing import CliRunner

from manager.cli import app as cli
from tests.api.test_openapi_contract import TOKEN
from tests.audit.conftest import BEARER, audit_rows

HF_TOKEN = "hf_AuditSecretValue0123456789"
API_KEY = "sk-audit-api-key-7f3a9"
OTHER_KEY = "second-api-key-value-42"


def test_no_secret_appears_anywhere_in_the_audit_table(client, settings):
    config = {
        "name": "secretive",
        "model": "org/a",
        "env": {"HF_TOKEN": HF_TOKEN},
        "extra_args": ["--api-key", API_KEY],
    }
    assert client.post("/api/models", json=config, headers=BEARER).status_code == 201
    changed = {**config, "extra_args": [f"--api-key={OTHER_KEY}"], "max_num_seqs": 4}
    put = client.put("/api/models/secretive", json=changed, headers=BEARER)
    assert put.status_code == 200, put.text
    # Refused: its message may quote what it refuses, and is kept, with the values hidden.
    refused = {**config, "name": "refused", "extra_args": ["--api-key", API_KEY, "--trust-remote-code"]}
    answer = client.post("/api/models", json=refused, headers=BEARER)
    assert answer.status_code == 422, answer.text
    refused_env = {**config, "name": "refused-env", "env": {"HF_TOKEN": HF_TOKEN, "bad name": HF_TOKEN}}
    assert client.post("/api/models", json=refused_env, headers=BEARER).status_code == 422
    exported = client.get("/api/export", headers=BEARER)
    assert HF_TOKEN in exported.text  # the export holds it, and the import sends it back
    assert client.post("/api/import", content=exported.content, headers=BEARER).status_code < 500
    key = client.post("/api/keys", json={"name": "app"}, headers=BEARER).json()["key"]
    logged_in = client.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert logged_in.status_code == 303
    client.cookies.clear()
    made = CliRunner().invoke(cli, ["token", "create", "--name", "ci", "--data-dir", str(settings.data_dir)])
    assert made.exit_code == 0, made.output
    stored = made.stdout.strip().splitlines()[0]
    rotated = CliRunner().invoke(cli, ["token", "rotate", "ci", "--data-dir", str(settings.data_dir)])
    assert rotated.exit_code == 0, rotated.output
    new = rotated.stdout.strip().splitlines()[0]
    assert new.startswith("vmt_") and stored.startswith("vmt_")
    client.delete("/api/models/secretive", headers={"Authorization": f"Bearer {new}"})

    rows = audit_rows(client)
    table = repr(rows)
    for secret in (HF_TOKEN, API_KEY, OTHER_KEY, key, TOKEN, stored, new):
        assert secret not in table, secret
        assert secret[4:16] not in table, secret  # nor a part of it
    actions = [r["action"] for r in rows]
    assert actions == [
        "models.create", "models.update", "models.create", "models.create", "import", "keys.create", "login",
        "tokens.create", "tokens.rotate", "models.delete",
    ]  # fmt: skip
    assert rows[0]["fields"] == '["env", "extra_args", "model", "name"]'
    # The update sent every field; it changed two, and the row names those (an empty list for a create).
    assert rows[1]["changed"] == '["extra_args", "max_num_seqs"]' and rows[0]["changed"] == "[]"
    assert rows[2]["message"] and rows[2]["status"] == 422  # the refusal's reason is kept
    assert rows[-1]["who"].startswith("token:") and rows[-1]["token_name"] == "ci"
