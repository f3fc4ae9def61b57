"""Validate an engine argv with vLLM's own parser, run by the engine's interpreter.

The check runs in a child process of the engine's Python so that it uses exactly the vLLM (and the
plugins) that will serve, not whatever the manager happens to import.
"""

from __future__ import annotations

import errno
import json
import subprocess
from dataclasses import dataclass

from manager.launch.command import inherited_env

# Runs inside the engine interpreter. Reads the argv as JSON on stdin (a long argv would not fit in one
# argument of its own command line) and prints one JSON line on its last line of stdout.
_CHECK = r"""
import contextlib, io, json, sys
argv = json.loads(sys.stdin.read())
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


def cannot_run(engine_python: str, exc: OSError | ValueError) -> str:
    """Why the engine interpreter could not be started with this command, in the user's terms."""
    if isinstance(exc, ValueError):  # subprocess: "embedded null byte"
        return (
            "the command line or environment holds a NUL byte, which no process can be given: "
            "remove it from the model config's extra_args or env"
        )
    if exc.errno == errno.E2BIG:
        return (
            "the command line and environment are too long for this system to start a process with: "
            "shorten the model config's extra_args or env (or the manager's own environment)"
        )
    return f"cannot run the engine interpreter {engine_python!r}: {exc}; check VLLM_MANAGER_ENGINE_PYTHON"


def _run_check(engine_python: str, engine_argv: list[str], env: dict[str, str], timeout_s: float) -> Validation:
    if any("\0" in part for part in [*engine_argv, *env, *env.values()]):
        # json.dumps would carry it to vLLM's parser, which accepts it; starting the engine would not.
        return Validation("rejected", cannot_run(engine_python, ValueError("embedded null byte")))
    child_env = {**inherited_env(), "VLLM_LOGGING_LEVEL": "ERROR", **env}
    try:
        proc = subprocess.run(
            [engine_python, "-c", _CHECK],
            input=json.dumps(engine_argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env,
        )
    except (FileNotFoundError, PermissionError):
        return Validation("skipped", f"the engine interpreter {engine_python!r} cannot be run")
    except (OSError, ValueError) as exc:
        return Validation("rejected", cannot_run(engine_python, exc))
    except subprocess.TimeoutExpired:
        return Validation("skipped", f"vLLM's parser did not answer within {timeout_s:.0f} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            data = json.loads(line)
            return Validation(data["status"], data["message"], data.get("vllm_version"))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return Validation("skipped", f"the validation process failed: {tail[0]}")
