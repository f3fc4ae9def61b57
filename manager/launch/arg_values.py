"""Check the values of engine args that can name code, as vLLM will read them (rules: arg_rules.py).

vLLM takes a JSON arg whole (`--compilation-config '{"mode": 3}'`, `-cc={...}`) or one key at a time
(`--compilation-config.mode 3`, `-cc.custom_ops+ a,b`), and any unambiguous abbreviation of its name;
every form is read here into the object vLLM would build, and that object is checked against the rule.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from manager.errors import Invalid
from manager.launch.arg_rules import (
    COMPILATION,
    JSON_ARGS,
    OTHER_FLAGS,
    PLAIN_ARGS,
    JsonArg,
    NoImportPath,
    OneOf,
    Refused,
    Spec,
)
from manager.launch.flags import flag_name

OPT_OUT = "an operator can allow it with VLLM_MANAGER_ALLOW_CODE_FLAGS=1"


class _Object(list):
    """A JSON object as its (key, value) pairs: a key given twice is checked twice."""


def check_arg_values(args: list[str], allow_code_flags: bool) -> None:
    """Refuse (422) a JSON arg that is not valid JSON, and keys or values that load code (unless allowed)."""
    for i, arg in enumerate(args):
        flag = flag_name(arg)
        if flag is None:
            continue
        found = _read(arg, flag, args[i + 1] if i + 1 < len(args) else None)
        if found is None or allow_code_flags:
            continue
        refusal = _walk(*found, ())
        if refusal:
            raise Invalid(f"extra_args: {flag} {refusal}; {OPT_OUT}", field="extra_args")


def _read(arg: str, flag: str, following: str | None) -> tuple[Spec, Any] | None:
    """The rule for `arg` and the value it gives, read as vLLM reads it; None for an arg not checked here."""
    if flag.startswith("-O"):
        value = _optimization(arg, following)
        return None if value is None else (COMPILATION, value)
    given = arg.split("=", 1)[1] if "=" in arg else following
    if given is None:
        return None
    name, dot, keys = _canonical(flag).partition(".")
    plain = None if dot else _resolve(name, PLAIN_ARGS)
    if plain is not None:
        return plain, _loose(given)
    json_arg = _resolve(name, JSON_ARGS)
    if json_arg is None:
        return None
    return json_arg.spec, (_dotted(keys, given) if dot else _parse(json_arg, flag, given))


def _canonical(flag: str) -> str:
    # vLLM turns '_' into '-' in a flag's name, up to the first '.' (the keys after it stay as written).
    if not flag.startswith("--"):
        return flag
    name, dot, keys = flag.partition(".")
    return name.replace("_", "-") + dot + keys


def _resolve(name: str, table: Mapping[str, Any]) -> Any:
    """The table entry `name` means: its own, or the one it abbreviates (argparse takes any unambiguous prefix)."""
    if name in table:
        return table[name]
    if name in OTHER_FLAGS or len(name) < 2:
        return None
    long = name.startswith("--")
    hits = {id(v): v for k, v in table.items() if k.startswith(name) and k.startswith("--") == long}
    return next(iter(hits.values())) if len(hits) == 1 else None


def _optimization(arg: str, following: str | None) -> Any:
    """-O is the optimization level in vLLM 0.32 (-O3, -O 3, -Odecode); before 0.12 it was the compilation
    config (-O '{...}', -O.key value), and those forms are checked as one."""
    rest = arg[2:]
    if rest.startswith("."):
        keys, eq, value = rest[1:].partition("=")
        given = value if eq else following
        return _dotted(keys, given) if given is not None else None
    text = rest[1:] if rest.startswith("=") else (rest or following)
    if text is None or not text.lstrip().startswith("{"):
        return None
    return _parse(JsonArg(("-O",), COMPILATION), "-O", text)


def _parse(arg: JsonArg, written: str, text: str) -> Any:
    if text in ("", "None"):
        return None  # vLLM's "not set"
    if arg.object_or_text and not re.match(r"(?s)^\s*{.*}\s*$", text):
        return text
    try:
        return json.loads(_plain_numbers(text), object_pairs_hook=_Object)
    except ValueError as exc:
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        message = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise Invalid(
            f"extra_args: the value of {written} is not valid JSON: {message}{where}", field="extra_args"
        ) from None


def _plain_numbers(text: str) -> str:
    # vLLM accepts bare sizes such as 80g or 4k inside JSON values; any number does for this check.
    parts = re.split(r'("(?:[^"\\]|\\.)*")', text)
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b", "0", parts[i])
    return "".join(parts)


def _loose(text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_Object)
    except ValueError:
        return text


def _dotted(keys: str, given: str) -> Any:
    """`--arg.a.b value` as the object vLLM makes of it: {"a": {"b": value}}; `a.b+ x,y` appends a list."""
    path = keys.split(".")
    value: Any = given.split(",") if path[-1].endswith("+") else _loose(given)
    path[-1] = path[-1].removesuffix("+")
    for key in reversed(path):
        value = _Object([(key, value)])
    return value


def _walk(spec: Spec, value: Any, path: tuple[str, ...]) -> str | None:
    """Why `value` is refused under `spec`, as the end of a sentence, or None."""
    where = ".".join(path)
    if spec is None:
        return None
    if isinstance(spec, Refused):
        return f"sets {where}, which is refused because it {spec.why}"
    given = f"sets {where} to {_shown(value)}" if where else f"is given {_shown(value)}"
    if isinstance(spec, OneOf):
        if isinstance(value, str) and value in spec.values:
            return None
        return f"{given}, which is refused because {spec.why}"
    if isinstance(spec, NoImportPath):
        if isinstance(value, str) and _is_import_path(value):
            return f"{given}, which {spec.why}"
        return None
    if not isinstance(value, _Object):
        return None  # not an object: vLLM refuses the type itself
    for key, item in value:
        if key not in spec.allowed:
            return f"sets {'.'.join((*path, key))}, which is not a key known not to load code"
        refusal = _walk(spec.allowed[key], item, (*path, key))
        if refusal:
            return refusal
    return None


def _shown(value: Any) -> str:
    if isinstance(value, _Object):
        return json.dumps(dict(value))
    return repr(value)


def _is_import_path(value: str) -> bool:
    # vLLM's own test: dotted identifiers, no '/', not a URL.
    if value.startswith(("http://", "https://", "file://")) or "/" in value:
        return False
    parts = value.split(".")
    return len(parts) >= 2 and all(part.isidentifier() for part in parts)
