"""Shared field rules."""

from __future__ import annotations

import difflib
import re
import types
import typing
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StringConstraints, ValidationInfo

SLUG = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
SLUG_RULE = "1-63 characters: lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ENV_NAME_RULE = "letters, digits and '_', not starting with a digit"
# What a reader without the token sees in place of a secret (an env value, a credential flag's value, a
# cache path from a config's env); sent back unchanged, it keeps the stored value.
MARKER = "<hidden>"


# Text limits: roomy for real use, and small enough that a stored config always makes a command line
# Linux accepts (one argument or environment entry at most 128 KiB, all of them about 2 MiB).
MAX_NAME = 63
MAX_PATH = 4096
MAX_SHORT = 256
MAX_ARG = 16 * 1024
MAX_ARGS = 256
MAX_ENV_VALUE = 16 * 1024
MAX_ENV = 128
MAX_DESCRIPTION = 4096
MAX_COMMAND_BYTES = 256 * 1024  # extra_args and env together, in bytes as the engine's command line holds them
MAX_GPU_ID = 255
MAX_GPUS = 64  # GPU ids a config lists: one machine's
# GPUs one engine may use: tensor x pipeline x data parallel size, over every node of a cluster (128 nodes
# of 8 GPUs). A larger value is a mistake, and nothing in the manager is sized by it.
MAX_ENGINE_GPUS = 1024
# Every number has a bound a machine can reach (SQLite and JSON both care), which also keeps out Infinity
# and NaN: counts and seconds up to MAX_INT, sizes in GiB up to MAX_GIB.
MAX_INT = 2**31 - 1
MAX_REPLICAS = 16  # workers of one model: more is a typo, and each takes a start and a port
MAX_CONCURRENT = 4096  # requests in flight for one model at once (its max_concurrent)
MAX_RESIDENCY_S = 3600  # a model's min_residency_s: longer would keep a model that shares its GPU waiting for an hour
MAX_GIB = 1 << 20  # a mebibyte of GiB: larger than any machine, small enough to stay exact in bytes
MAX_BYTES = MAX_GIB << 30

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # tab, newline and CR are allowed


def _refuse(pattern: re.Pattern[str], allowed: str):
    def check(value: str) -> str:
        found = pattern.search(value)
        if found:
            raise ValueError(
                f"holds a control character (U+{ord(found.group()):04X} at position {found.start()}); "
                f"{allowed}: remove it"
            )
        return value

    return check


single_line = _refuse(_CONTROL, "this field takes printable text on one line")
multi_line = _refuse(_CONTROL_BUT_LINES, "this field takes printable text, tabs and line breaks")

# The rule is checked by the validator, whose message says where the character is; the schema states it too.
_SINGLE_LINE_SCHEMA = Field(json_schema_extra={"pattern": r"^[^\x00-\x1f\x7f]*$"})
_MULTI_LINE_SCHEMA = Field(json_schema_extra={"pattern": r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"})

Name = Annotated[str, StringConstraints(max_length=MAX_NAME), AfterValidator(single_line), _SINGLE_LINE_SCHEMA]
PathText = Annotated[str, StringConstraints(max_length=MAX_PATH), AfterValidator(single_line), _SINGLE_LINE_SCHEMA]
ShortText = Annotated[str, StringConstraints(max_length=MAX_SHORT), AfterValidator(single_line), _SINGLE_LINE_SCHEMA]
Argument = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_ARG), AfterValidator(single_line), _SINGLE_LINE_SCHEMA
]
# Its characters are checked by the config's own validator, which names the key; ENV_NAMES states the rule.
EnvName = Annotated[str, StringConstraints(max_length=MAX_SHORT)]
ENV_NAMES: dict[str, Any] = {"propertyNames": {"maxLength": MAX_SHORT, "pattern": ENV_NAME.pattern}}
EnvValue = Annotated[str, StringConstraints(max_length=MAX_ENV_VALUE), AfterValidator(single_line), _SINGLE_LINE_SCHEMA]
Description = Annotated[
    str, StringConstraints(max_length=MAX_DESCRIPTION), AfterValidator(multi_line), _MULTI_LINE_SCHEMA
]


GpuId = Annotated[int, Field(ge=0, le=MAX_GPU_ID)]
# Distinct items: checked by validators whose messages name the repeats; the schema states it too.
UNIQUE_ITEMS: dict[str, Any] = {"uniqueItems": True}


def _takes(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field takes a value of one of these types (or a list of them), optional or not."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        return any(_takes(a, kinds) for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Annotated:
        return _takes(typing.get_args(annotation)[0], kinds)
    return annotation in kinds


def keep_bools_and_numbers_apart(cls, value: Any, info: ValidationInfo) -> Any:
    """A field validator (mode="before", all fields), for what the schema says of JSON's types: true is
    not the number 1 (``lora_pool_gib: true`` would be stored as 1.0, ``gpu_ids: [true]`` as GPU 1), and
    0 or "no" is not false."""
    if not info.field_name:
        return value
    annotation = cls.model_fields[info.field_name].annotation
    given = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) for v in given) and _takes(annotation, (int, float)):
        raise ValueError("must be a number, not true or false")
    if value is not None and not isinstance(value, bool) and annotation in (bool, bool | None):
        raise ValueError("must be true or false")
    return value


# Fields a client reads back and may send with a replacement (PUT): accepted and ignored there.
READ_ONLY = frozenset({"name", "created_at", "updated_at"})


def refuse_unknown_fields(cls, data: Any, ignored: frozenset[str] = frozenset()) -> Any:
    """For a model validator (mode="before"): a field the model does not have is refused, naming the
    closest real one ("max_model_length (did you mean max_model_len?)"), instead of being dropped
    silently; ``ignored`` fields are taken out first."""
    if not isinstance(data, dict):
        return data
    known = set(cls.model_fields)
    unknown = [str(k) for k in data if k not in known and k not in ignored]
    if unknown:
        named, guessed = [], True
        for field in unknown:
            close = difflib.get_close_matches(field, sorted(known), n=1, cutoff=0.6)
            named.append(f"{field!r} (did you mean {close[0]}?)" if close else repr(field))
            guessed = guessed and bool(close)
        plural = "s" if len(unknown) > 1 else ""
        listed = "" if guessed else f"; the fields are: {', '.join(sorted(known))}"
        raise ValueError(f"unknown field{plural} {', '.join(named)}{listed}")
    return {k: v for k, v in data.items() if k not in ignored} if ignored else data


def command_bytes(extra_args: list[str], env: dict[str, str]) -> int:
    """What extra_args and env take of the engine's command line and environment, in bytes."""
    return sum(len(a.encode()) + 1 for a in extra_args) + sum(len(f"{k}={v}".encode()) + 1 for k, v in env.items())


def check_slug(value: str) -> str:
    if not SLUG.fullmatch(value):
        raise ValueError(f"must be a slug ({SLUG_RULE}), got {value!r}")
    return value


# A name that requests and URLs use (model configs, profiles, adapters, aliases). The validator's message
# says the rule in words; the schema states the pattern.
Slug = Annotated[
    str,
    StringConstraints(max_length=MAX_NAME),
    AfterValidator(check_slug),
    Field(json_schema_extra={"pattern": SLUG.pattern}),
]


def expand_home(path: str) -> Path:
    """``Path(path).expanduser()``, where a ``~user`` this machine does not have is a ValueError that
    says what to do (pathlib raises a RuntimeError, which would reach the user as a 500)."""
    try:
        return Path(path).expanduser()
    except RuntimeError as exc:
        raise ValueError(
            "starts with '~' for a home folder this machine does not have (no such user, or no HOME set): "
            "give the full path instead"
        ) from exc


def utcnow() -> datetime:
    return datetime.now(UTC)
