"""Validate an engine argv with vLLM's own parser, run by the engine's interpreter.

The check runs in a child process of the engine's Python so that it uses exactly the vLLM (and the
plugins) that will serve, not whatever the manager happens to import.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass

# Runs inside the engine interpreter. Prints one JSON line on its last line of stdout.
_CHECK = r"""
import contextlib, io, json, sys
argv = json.loads(sys.argv[1])
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    import vllm
except Exception as exc:
    print(json.dumps({"status": "skipped", "message": f"vLLM is not importable here: {exc!r}"}))
    sys.exit(0)
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
err = io.StringIO()
try:
    with contextlib.redirect_stderr(err):
        args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
except SystemExit:
    lines = [l for l in err.getvalue().splitlines() if l.strip()]
    msg = next((l for l in reversed(lines) if "error:" in l), lines[-1] if lines else "rejected")
    print(json.dumps({"status": "rejected", "message": msg, "vllm_version": vllm.__version__}))
    sys.exit(0)
except Exception as exc:
    print(json.dumps({"status": "rejected", "message": str(exc), "vllm_version": vllm.__version__}))
    sys.exit(0)
print(json.dumps({"status": "valid", "message": "accepted by vLLM's parser", "vllm_version": vllm.__version__}))
"""


@dataclass(frozen=True)
class Validation:
    status: str  # "valid", "rejected" or "skipped"
    message: str
    vllm_version: str | None = None


# Answers for the same interpreter, argv and environment do not change; building vLLM's parser takes
# seconds, so a command preview asked for twice is answered from here. "skipped" is never kept.
_answers: dict[tuple, Validation] = {}


def validate_engine_argv(
    engine_python: str,
    engine_argv: list[str],
    env: dict[str, str] | None = None,
    timeout_s: float = 180.0,
) -> Validation:
    key = (engine_python, tuple(engine_argv), tuple(sorted((env or {}).items())))
    if key in _answers:
        return _answers[key]
    answer = _run_check(engine_python, engine_argv, env or {}, timeout_s)
    if answer.status != "skipped":
        _answers[key] = answer
    return answer


def _run_check(engine_python: str, engine_argv: list[str], env: dict[str, str], timeout_s: float) -> Validation:
    child_env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", **env}
    try:
        proc = subprocess.run(
            [engine_python, "-c", _CHECK, json.dumps(engine_argv)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env,
        )
    except (FileNotFoundError, PermissionError):
        return Validation("skipped", f"the engine interpreter {engine_python!r} cannot be run")
    except subprocess.TimeoutExpired:
        return Validation("skipped", f"vLLM's parser did not answer within {timeout_s:.0f} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            data = json.loads(line)
            return Validation(data["status"], data["message"], data.get("vllm_version"))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return Validation("skipped", f"the validation process failed: {tail[0]}")
