"""The key an engine asks its clients for (vLLM's --api-key): given through the environment, never argv.

A process's command line is readable by every local user (``ps``), its environment only by its own
user. vLLM 0.32 takes its key from ``--api-key`` or, when that flag is absent, from ``VLLM_API_KEY``
(``entrypoints/serve/middleware/register.py``), and then refuses every request under /v1 (and /v2,
/inference, /cohere) without ``Authorization: Bearer <key>``; /health, /metrics and the dev endpoints
(/sleep, /wake_up, ...) stay open. So a config's ``--api-key X`` becomes ``VLLM_API_KEY=X`` in its
engine's environment, and the manager's own calls to that engine (the readiness probe's /v1/models,
the LoRA endpoints, the requests /v1 forwards) carry the key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from manager.errors import Invalid
from manager.launch.flags import flag_name

ENV_NAME = "VLLM_API_KEY"
# What vLLM's parser reads as --api-key: underscores count as dashes, and a prefix that names no other
# flag stands for the whole one (--api- could also be --api-server-count: vLLM refuses it).
_SPELLINGS = frozenset({"--api-key", "--api-ke", "--api-k"})


def is_key_flag(flag: str) -> bool:
    return flag.replace("_", "-") in _SPELLINGS


def key_values(argv: Sequence[str]) -> list[str] | None:
    """The keys an argv gives vLLM's --api-key (the last time it is given, as vLLM's parser reads it), or
    None when it does not give the flag. ``--api-key=X`` holds one key, ``--api-key X Y`` the values up
    to the next flag."""
    found: list[str] | None = None
    taking = False
    for arg in argv:
        flag = flag_name(arg)
        if flag is None:
            if taking and found is not None:
                found.append(arg)
            continue
        taking = is_key_flag(flag)
        if taking:
            found = [arg.split("=", 1)[1]] if "=" in arg else []
            taking = "=" not in arg
    return found


def without_key_flag(argv: Sequence[str]) -> list[str]:
    """The argv without its --api-key flags and their values."""
    kept: list[str] = []
    taking = False
    for arg in argv:
        flag = flag_name(arg)
        if flag is None:
            if not taking:
                kept.append(arg)
            continue
        taking = is_key_flag(flag)
        if not taking:
            kept.append(arg)
    return kept


def engine_key(extra_args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The key an engine of these extra_args and env asks for: --api-key's, else VLLM_API_KEY (vLLM's
    own order); None when it asks for none (an empty key turns vLLM's check off)."""
    given = key_values(extra_args)
    if given is None:
        return env.get(ENV_NAME) or None
    keys = [key for key in given if key]
    if len(keys) > 1:
        raise Invalid(
            f"extra_args: --api-key gives the engine {len(keys)} keys; the manager hands the engine its key "
            f"through {ENV_NAME}, which holds one (keep one key; give each client an inference key of the "
            "manager's /v1 instead)",
            field="extra_args",
        )
    return keys[0] if keys else None


def key_through_env(extra_args: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """extra_args without --api-key, and env with the engine's key (if any) as VLLM_API_KEY."""
    key = engine_key(extra_args, env)
    moved = {name: value for name, value in env.items() if name != ENV_NAME}
    if key is not None:
        moved[ENV_NAME] = key
    return without_key_flag(extra_args), moved


def bearer(key: str | None) -> dict[str, str]:
    """The header a call to an engine that asks for ``key`` carries."""
    return {"Authorization": f"Bearer {key}"} if key else {}
