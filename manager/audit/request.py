"""What the audit log keeps of a request and its answer, and what it never keeps.

Of the body only the names of its top-level fields (an env value, an --api-key in extra_args or a token
is a value, never written), and the name it creates or acts on where it has one. An error message is
kept with every value the request sent in a secret's place (env values, extra_args, any field named like
a token, key, secret or password) and anything shaped like a token or key replaced by ``<hidden>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl

from manager.launch.secrets import Redactor
from manager.schemas.audit import MAX_FIELDS, MAX_TARGET
from manager.schemas.common import MARKER

# A path of one word that is itself the action, not a collection to create in.
ACTIONS = frozenset({"import", "plan", "login", "logout"})
# Fields of a body that name what is created or acted on, first found wins (after the path's own).
TARGET_FIELDS = ("name", "model", "repo")
FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
SECRET_FIELD = re.compile(r"token|key|secret|password|credential|auth", re.IGNORECASE)
SECRET_SHAPES = re.compile(r"\b(?:vmt|vmk|hf|sk)_[A-Za-z0-9_-]{8,}|\b[Bb]earer\s+[A-Za-z0-9._~+/=-]{16,}")
SHORTEST_SECRET = 4  # shorter values are not hidden from messages: they would hide words instead


REFUSED_BEFORE_ROUTING = "request.refused"  # the action of a request refused before any route ran


def path_asked(path: str) -> str:
    """A path no route matched, as the log keeps it: printable characters only, and not too long."""
    return "".join(c if c.isprintable() else "?" for c in path)[:MAX_TARGET]


def action_of(method: str, template: str) -> str:
    """A short name for what a route does, from its template: models.update, workers.stop, keys.create."""
    parts = [p for p in template.strip("/").split("/") if p]
    if parts and parts[0] in ("api", "ui"):
        parts = parts[1:]
    words = [p for p in parts if not p.startswith("{")]
    if not words:
        return method.lower()
    if parts[-1].startswith("{"):  # an item: changed or deleted
        return ".".join([*words, "delete" if method == "DELETE" else "update"])
    if any(p.startswith("{") for p in parts) or len(words) > 1:  # a verb on an item, or a named form
        return ".".join(words).replace(".new", ".create")
    if words[0] in ACTIONS:
        return words[0]
    return f"{words[0]}.{'delete' if method == 'DELETE' else 'create'}"


def parse_body(body: bytes, content_type: str) -> Any:
    """The body as JSON or form data (a dict of lists), or None when it is neither or cannot be read."""
    kind = content_type.split(";")[0].strip().lower()
    try:
        if kind == "application/x-www-form-urlencoded":
            form: dict[str, list[str]] = {}
            for name, value in parse_qsl(body.decode(), keep_blank_values=True):
                form.setdefault(name, []).append(value)
            return form
        if kind == "application/json" or kind.endswith("+json") or (not kind and body[:1] in (b"{", b"[")):
            return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return None


def fields_of(data: Any) -> list[str]:
    """The names of the fields a body sent (top level only), never their values."""
    if not isinstance(data, dict):
        return []
    return sorted(name for name in data if isinstance(name, str) and FIELD_NAME.match(name))[:MAX_FIELDS]


def target_of(path_params: dict[str, Any], data: Any) -> str | None:
    """The id or name acted on: the path's own, else the name a body creates or starts."""
    if path_params:
        return "/".join(str(v) for v in path_params.values())[:MAX_TARGET]
    if isinstance(data, dict):
        for name in TARGET_FIELDS:
            value = data.get(name)
            if isinstance(value, list) and len(value) == 1:  # a form field
                value = value[0]
            if isinstance(value, str) and value and value.isprintable():
                return value[:MAX_TARGET]
    return None


def secrets_in(data: Any, secret: bool = False) -> Iterator[str]:
    """Every string a body sent where a secret may be: under env, in an argument list (a flag's value,
    not its name), or under a field named like a token, key, secret or password (at any depth)."""
    if isinstance(data, dict):
        for name, value in data.items():
            name = str(name).lower()
            yield from secrets_in(value, secret or "env" in name or "args" in name or bool(SECRET_FIELD.search(name)))
    elif isinstance(data, list):
        for item in data:
            yield from secrets_in(item, secret)
    elif isinstance(data, str) and secret:
        if not data.startswith("-"):
            yield data
        elif "=" in data:  # --api-key=value
            yield data.split("=", 1)[1]


def scrub(message: str, secrets: set[str]) -> str:
    """The message with each of these values, anything shaped like a token or key, any secret flag's
    value however short (--api-key abc) and the user part of any URL as <hidden>."""
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= SHORTEST_SECRET:
            message = message.replace(secret, MARKER)
    return Redactor().text(SECRET_SHAPES.sub(MARKER, message))


def error_message(body: bytes, content_type: str) -> str | None:
    """What an error answer says was wrong: the manager's ``detail``, or OpenAI's ``error.message``."""
    if "json" not in content_type.lower():
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    detail = data.get("detail")
    if isinstance(detail, str):
        return detail
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return None
