"""`vllm-manager plan MODEL` as a user runs it."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from manager.cli_plan import plan
from tests.planner.conftest import load_config

app = typer.Typer()
app.command()(plan)


def _model(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(load_config(name)))
    return str(tmp_path)


def test_plan_prints_the_table_and_exits_1_when_it_does_not_fit(tmp_path):
    folder = _model(tmp_path, "Qwen3-Coder-30B-A3B-Instruct-AWQ")
    result = CliRunner().invoke(
        app,
        [
            folder,
            "--gpu",
            "rtx-4090",
            "--max-model-len",
            "52000",
            "--gpu-memory-utilization",
            "0.88",
            "--host-ram-gib",
            "128",
            "--kv-offload-gib",
            "16",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "DOES NOT FIT" in result.output
    assert "--kv-cache-dtype fp8" in result.output
    assert "Prefix-cache capacity added by CPU KV offload" in result.output


def test_plan_fits_exits_0_and_json_is_the_api_shape(tmp_path):
    folder = _model(tmp_path, "Llama-3.1-8B-Instruct")
    result = CliRunner().invoke(
        app, [folder, "--gpu", "h100-80", "--max-model-len", "8192", "--host-ram-gib", "128", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["verdict"]["fits"] is True


def test_missing_model_exits_2_with_the_reason(tmp_path):
    result = CliRunner().invoke(app, [str(tmp_path / "nothing"), "--gpu", "h100-80"])
    assert result.exit_code == 2
