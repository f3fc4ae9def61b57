"""`vllm-manager keys` and `usage`, straight in the store; `serve` says when /v1 is opened on a public address."""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import yaml

from tests.cli.test_cli import CLI, _free_port, _run


def test_keys_create_list_revoke(tmp_path):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"name": "a", "model": "org/x"}))
    data = tmp_path / "data"
    assert _run(["models", "add", str(tmp_path / "m.yaml")], data).returncode == 0
    unknown = _run(["keys", "create", "app", "--models", "a,b"], data)
    assert unknown.returncode == 1 and "no model config named 'b'" in unknown.stderr
    made = _run(["keys", "create", "app", "--models", "a"], data)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("vmk_") and "not shown again" in made.stderr
    listed = _run(["keys", "list"], data).stdout
    assert "app" in listed and key[:12] in listed and key[12:] not in listed and "active" in listed
    assert "needs one of the active inference keys" in _run(["keys", "list"], data).stderr
    busy = _run(["keys", "open-v1"], data)
    assert busy.returncode == 1 and "active inference keys exist (app)" in busy.stderr
    revoked = _run(["keys", "revoke", "app"], data)
    assert revoked.returncode == 0 and "keys open-v1" in revoked.stderr
    shown = _run(["keys", "list"], data)
    assert "revoked" in shown.stdout and "stays closed" in shown.stderr
    again = _run(["keys", "revoke", "app"], data)
    assert again.returncode == 1 and "no active inference key named 'app'" in again.stderr
    opened = _run(["keys", "open-v1"], data)
    assert opened.returncode == 0 and "needs no inference key" in opened.stdout
    bad = _run(["keys", "create", "Not A Slug"], data)
    assert bad.returncode == 1 and "slug" in bad.stderr


def test_usage_prints_a_report_and_explains_bad_ranges(tmp_path):
    shown = _run(["usage", "--since", "6h"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "per hour" in shown.stdout and "requests" in shown.stdout
    too_long = _run(["usage", "--since", "3d", "--per", "minute"], tmp_path)
    assert too_long.returncode == 1 and "per=hour" in too_long.stderr
    assert "this range is 3 days:" in too_long.stderr  # as a person says it, not "3 days, 0:00:00.132541"
    garbled = _run(["usage", "--since", "yesterday"], tmp_path)
    assert garbled.returncode == 1 and "--since takes" in garbled.stderr


def test_serve_warns_when_v1_is_opened_on_a_public_address(tmp_path):
    assert _run(["token", "create"], tmp_path).returncode == 0
    port = _free_port()
    env = {**os.environ, "VLLM_MANAGER_API_TOKEN": "", "VLLM_MANAGER_OPEN_INFERENCE": "1"}
    proc = subprocess.Popen(
        CLI + ["serve", "--host", "0.0.0.0", "--port", str(port), "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "the manager did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert "/v1 is open to anyone who reaches 0.0.0.0 (VLLM_MANAGER_OPEN_INFERENCE is set)" in output


def test_keys_take_limits_on_create_and_set(tmp_path):
    data = tmp_path / "data"
    made = _run(["keys", "create", "app", "--rpm", "60", "--token-budget", "1000", "--budget-period", "day",
                 "--expires", "30d", "--priority", "batch"], data)  # fmt: skip
    assert made.returncode == 0, made.stderr
    listed = _run(["keys", "list"], data).stdout
    assert "rpm 60" in listed and "tokens/day 1000" in listed and "expires 20" in listed and "batch" in listed
    changed = _run(["keys", "set", "app", "--rpm", "none", "--tpm", "5000"], data)
    assert changed.returncode == 0, changed.stderr
    assert "tpm 5000" in changed.stdout and "rpm" not in changed.stdout.replace("tpm", "")
    for args, said in (
        (["--rpm", "0"], "rpm"),
        (["--tpm", "lots"], "tpm"),
        (["--budget-period", "week"], "budget_period"),
        (["--expires", "2020-01-01"], "has passed"),
        ([], "give at least one"),
    ):
        refused = _run(["keys", "set", "app", *args], data)
        assert refused.returncode == 1 and said in refused.stderr, (args, refused.stderr)
    assert _run(["keys", "set", "nobody", "--rpm", "1"], data).returncode == 1
    bad = _run(["keys", "create", "other", "--max-concurrent", "-1"], data)
    assert bad.returncode == 1 and "max_concurrent" in bad.stderr
