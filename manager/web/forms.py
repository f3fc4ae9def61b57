"""HTML forms to and from the API's pydantic schemas, with errors by field.

The pages validate with the very schemas and services the REST API uses, so a form shows the same
messages as a 422 body, next to the field they are about. Only the text encoding of a few field
types is the form's own: GPU ids "0,1", extra args as a shell line, env as KEY=VALUE lines.
"""

from __future__ import annotations

import shlex
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from manager.audit import changes
from manager.errors import ManagerError

SchemaT = TypeVar("SchemaT", bound=BaseModel)

FORM_LEVEL = "_form"  # errors about several fields at once (a model validator) or none


@dataclass
class FormErrors:
    by_field: dict[str, list[str]] = field(default_factory=dict)

    def add(self, name: str, message: str, status: int = 422) -> None:
        """An error shown next to its field; on a write, also why the audit log says it was refused
        (``status``: what the API answers the same refusal with)."""
        self.by_field.setdefault(name or FORM_LEVEL, []).append(message)
        changes.refused(status, message if name in ("", FORM_LEVEL) else f"{name}: {message}")

    def __bool__(self) -> bool:
        return bool(self.by_field)

    def get(self, name: str) -> list[str]:
        return self.by_field.get(name, [])


def refusal(exc: ManagerError) -> str:
    """The message a page shows for a refused change, noted for the audit log with the API's status."""
    changes.refused(exc.status, exc.message)
    return exc.message


TRISTATE_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def _bare(annotation: Any) -> Any:
    """The type under Annotated[...] (a GPU id is an int with bounds)."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def _kind(annotation: Any) -> str:
    """'bool', 'tristate', 'list_int', 'list_str', 'dict' or 'scalar' for a field's annotation."""
    args = [_bare(a) for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        # bool | None is three-state (on, off, the engine's default): a text field, not a checkbox.
        return "tristate" if args[0] is bool else _kind(args[0])
    if annotation is bool:
        return "bool"
    if origin is list:
        return "list_int" if args == [int] else "list_str"
    if origin is dict:
        return "dict"
    return "scalar"


def to_text(value: Any, annotation: Any) -> str:
    """A stored value as the form shows it (the inverse of ``parse_form``)."""
    kind = _kind(annotation)
    if value is None:
        return ""
    if isinstance(value, str):  # already form text (a form shown again with its errors)
        return value
    if isinstance(value, bool):  # a tri-state (True/False/None) field shown as text
        return "true" if value else "false"
    if kind == "list_int":
        return ", ".join(str(v) for v in value)
    if kind == "list_str":
        return shlex.join(value)
    if kind == "dict":
        return "\n".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def parse_form(form: Mapping[str, Any], schema: type[BaseModel], errors: FormErrors) -> dict[str, Any]:
    """Form text to the schema's input dict. Empty optional fields are left out (their default
    applies); text the form itself cannot split (an unclosed quote) is reported on the field."""
    data: dict[str, Any] = {}
    for name, info in schema.model_fields.items():
        kind = _kind(info.annotation)
        if kind == "bool":
            data[name] = name in form  # an unticked checkbox is not sent at all
            continue
        raw = (form.get(name) or "").strip()
        if not raw:
            if kind in ("list_int", "list_str"):
                data[name] = []
            elif kind == "dict":
                data[name] = {}
            continue
        if kind == "list_int":
            data[name] = [part.strip() for part in raw.replace(" ", ",").split(",") if part.strip()]
        elif kind == "list_str":
            try:
                data[name] = shlex.split(raw)
            except ValueError as exc:
                errors.add(name, f"cannot split into arguments: {exc}; check the quotes")
        elif kind == "tristate":
            data[name] = TRISTATE_WORDS.get(raw.lower(), raw)  # other text: the schema says what it takes
        elif kind == "dict":
            env: dict[str, str] = {}
            for number, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                key, sep, value = line.partition("=")
                if not sep:
                    errors.add(name, f"line {number} ({line.strip()!r}) is not KEY=VALUE")
                    continue
                env[key.strip()] = value.strip()
            data[name] = env
        else:
            data[name] = raw
    return data


def validate(schema: type[SchemaT], data: dict[str, Any], errors: FormErrors) -> SchemaT | None:
    """The schema's validation; each message lands on the field its location names."""
    if errors:
        return None
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            loc = err.get("loc") or ()
            name = str(loc[0]) if loc else FORM_LEVEL
            msg = err["msg"].removeprefix("Value error, ")
            if len(loc) > 1:
                msg = f"{'.'.join(str(p) for p in loc[1:])}: {msg}"
            errors.add(name, msg)
        return None
