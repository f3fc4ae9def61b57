"""The command line starts without loading what only some commands use: the web framework, the store,
the settings' machinery, the HTTP client and the Hub client wait until a command needs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LATE = ("fastapi", "sqlmodel", "sqlalchemy", "pydantic_settings", "httpx", "huggingface_hub", "yaml", "uvicorn")


def modules_loaded_by(code: str) -> set[str]:
    probe = f"import sys\n{code}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)}
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_command_line_and_its_help_load_no_server_store_or_hub_modules() -> None:
    loaded = modules_loaded_by(
        "from manager.cli import app\n"
        "try:\n    app(['plan', '--help'], prog_name='vllm-manager')\nexcept SystemExit:\n    pass"
    )

    assert "manager.cli_plan" in loaded  # the command was there to ask for help
    assert sorted(name for name in LATE if name in loaded) == []
