"""The engine flags the manager writes itself: one table from config field to flag, and argv readers.

The table builds the managed part of every launch argv (in its order, each flag and its value one
element) and tells the extra_args check which flags a config may not set itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def _given(value: Any) -> bool:
    return value is not None


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag, the launch value it carries, and how that value is written."""

    flag: str
    # The key of the value in the launch values: a model config field, or one the launch itself
    # decides (host, sleep mode from sleep_level, the KV offload size and backend from the profile).
    field: str
    aliases: tuple[str, ...] = ()  # other spellings vLLM accepts, refused in extra_args as well
    when: Callable[[Any], bool] = _given  # written only for a value this accepts
    # How the value is written, as `--flag=value`; None: a switch, `--flag` when true, `--no-flag` when false.
    text: Callable[[Any], str] | None = str
    needs: str | None = None  # written only when this other launch value is true
    instead: str | None = None  # what a refusal tells the user to set, when not the field itself
    # A switch extra_args may give as well: there it only repeats or overrides the field, and
    # refusing it would turn away stored configs that carry it.
    extra_args_may_set: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)

    def argv(self, values: Mapping[str, Any]) -> list[str]:
        value = values.get(self.field)
        if (self.needs and not values.get(self.needs)) or not self.when(value):
            return []
        if self.text is None:
            return [self.flag if value else "--no-" + self.flag[2:]]
        # One element: vLLM's parser never reads a value so written as a flag (`-cc.key` would be one).
        return [f"{self.flag}={self.text(value)}"]


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("--model", "model"),
    EngineFlag("--served-model-name", "served_model_name"),
    EngineFlag(
        "--host", "host", instead="(none: the manager sets it from VLLM_MANAGER_WORKER_HOST, default 127.0.0.1)"
    ),
    EngineFlag("--port", "port"),
    EngineFlag("--dtype", "dtype", when=lambda v: v != "auto"),
    EngineFlag("--quantization", "quantization", ("-q",), when=bool),
    EngineFlag("--tensor-parallel-size", "tensor_parallel_size", ("-tp",), when=lambda v: v != 1),
    # repr keeps every digit of the float the user stored.
    EngineFlag("--gpu-memory-utilization", "gpu_memory_utilization", ("--device-memory-utilization",), text=repr),
    EngineFlag("--max-model-len", "max_model_len"),
    EngineFlag("--max-num-seqs", "max_num_seqs"),
    EngineFlag("--kv-cache-dtype", "kv_cache_dtype", when=lambda v: v != "auto"),
    EngineFlag("--enforce-eager", "enforce_eager", when=bool, text=None, extra_args_may_set=True),
    EngineFlag("--enable-prefix-caching", "enable_prefix_caching", text=None, extra_args_may_set=True),
    EngineFlag("--enable-lora", "enable_lora", when=bool, text=None),
    EngineFlag("--max-loras", "max_loras", needs="enable_lora"),
    EngineFlag("--max-lora-rank", "max_lora_rank", needs="enable_lora"),
    EngineFlag("--max-cpu-loras", "max_cpu_loras", needs="enable_lora"),
    EngineFlag("--enable-sleep-mode", "enable_sleep_mode", when=bool, text=None, instead="sleep_level"),
    EngineFlag("--kv-offloading-size", "kv_offloading_size", instead="the offload profile's kv_offload_gib"),
    EngineFlag("--kv-offloading-backend", "kv_offloading_backend", instead="the offload profile"),
    # The manager's own probes, out of the engine's access log; extra_args may choose otherwise.
    EngineFlag("--disable-access-log-for-endpoints", "quiet_paths", extra_args_may_set=True),
)

# What the manager itself asks an engine every few seconds (health, readiness, metrics, sleep state):
# kept out of the engine's access log, where they drowned the requests a user looks for.
PROBED_PATHS = "/health,/v1/models,/metrics,/is_sleeping"
ACCESS_LOG_FLAGS = ("--disable-access-log-for-endpoints", "--disable-uvicorn-access-log")

# Every spelling of a flag the manager sets, and what to set instead: refused in extra_args.
MANAGED_FLAGS: dict[str, str] = {
    name: row.instead or row.field for row in ENGINE_FLAGS if not row.extra_args_may_set for name in row.names
}
# The flags the manager writes, as it writes them: each is that flag itself, not the start of a longer one.
WRITTEN_FLAGS = frozenset(
    {row.flag for row in ENGINE_FLAGS} | {"--no-" + row.flag[2:] for row in ENGINE_FLAGS if row.text is None}
)


def managed_argv(values: Mapping[str, Any]) -> list[str]:
    """The flags the manager writes for these launch values, in the table's order: `--flag=value`."""
    return [part for row in ENGINE_FLAGS for part in row.argv(values)]


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value given to `flag` in an argv (`--flag value` or `--flag=value`), or None."""
    for i, part in enumerate(argv):
        if part == flag and i + 1 < len(argv):
            return argv[i + 1]
        if part.startswith(flag + "="):
            return part.split("=", 1)[1]
    return None


def flag_name(arg: str) -> str | None:
    """The flag an argv element names (`--flag` of `--flag=value`), or None for a value."""
    if not arg.startswith("-") or arg == "-" or _is_number(arg):
        return None
    return arg.split("=", 1)[0]


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def quiet_paths(extra_args: list[str]) -> str | None:
    """The paths left out of the engine's access log: the manager's probes, unless extra_args decide
    the access log themselves."""
    return None if any(flag_name(arg) in ACCESS_LOG_FLAGS for arg in extra_args) else PROBED_PATHS
