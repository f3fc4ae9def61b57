"""Make the stored configs equal a file: what `vllm-manager apply` and `models set` do.

A file holds `models:` and `profiles:` lists (an export, or one written by hand without its
`format:` header). Items that differ from the store are created or replaced in one transaction,
through the import; items equal to their stored copy are left alone (so their `updated_at` stays);
with prune, stored items the file does not name are deleted afterwards, configs before profiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError
from sqlmodel import Session

from manager.errors import Invalid
from manager.schemas.model_config import ModelConfigUpdate
from manager.services import models, profiles, transfer

_STAMPS = {"name", "created_at", "updated_at"}


@dataclass
class Applied:
    created: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def read_file(source: str | bytes) -> dict[str, Any]:
    """A file for apply: an export, or the same lists without the export's header."""
    try:
        data = yaml.safe_load(source)
    except (yaml.YAMLError, RecursionError) as exc:
        raise Invalid(f"the file is not valid YAML: {exc}") from exc
    if not isinstance(data, dict) or not ({"models", "profiles"} & data.keys()):
        raise Invalid("the file needs a 'models:' list, a 'profiles:' list, or both")
    if "format" in data:
        return transfer.parse_yaml(source)
    return data


def apply_data(
    db: Session, data: dict[str, Any], *, prune: bool = False, rules: models.WriteRules = models.WriteRules()
) -> Applied:
    """Store what differs, leave what is equal, and with ``prune`` delete what the file leaves out."""
    result = Applied()
    stored_models = {m.name: models.to_public(db, m).model_dump(mode="json") for m in models.list_models(db)}
    stored_profiles = {p.name: profiles.to_public(p).model_dump(mode="json") for p in profiles.list_profiles(db)}
    wanted: dict[str, list[Any]] = {"profiles": [], "models": []}
    for kind, stored in (("profiles", stored_profiles), ("models", stored_models)):
        items = data.get(kind) or []
        if not isinstance(items, list):
            raise Invalid(f"{kind} must be a list")
        for item in items:
            name = item.get("name") if isinstance(item, dict) else None
            label = f"{kind[:-1]} {name}"
            if name in stored and _same(item, stored[name], kind):
                result.unchanged.append(label)
                continue
            wanted[kind].append(item)
            (result.changed if name in stored else result.created).append(label)
    if wanted["profiles"] or wanted["models"]:
        transfer.import_data(db, wanted, overwrite=True, rules=rules)
    if prune:
        named = {kind: {i.get("name") for i in data.get(kind) or [] if isinstance(i, dict)} for kind in wanted}
        for name in sorted(set(stored_models) - named["models"]):
            models.delete_model(db, name)
            result.removed.append(f"model {name}")
        for name in sorted(set(stored_profiles) - named["profiles"]):
            profiles.delete_profile(db, name)
            result.removed.append(f"profile {name}")
    return result


def _same(item: dict[str, Any], stored: dict[str, Any], kind: str) -> bool:
    """Whether a file's item, validated as the store would take it, equals the stored item."""
    schema = transfer.ModelConfigCreate if kind == "models" else transfer.OffloadProfileCreate
    try:
        given = schema.model_validate(item).model_dump(mode="json")
    except ValidationError:
        return False  # the import says what is wrong with it
    return {k: v for k, v in given.items() if k not in _STAMPS} == {k: v for k, v in stored.items() if k not in _STAMPS}


def set_fields(
    db: Session, name: str, changes: dict[str, Any], *, rules: models.WriteRules = models.WriteRules()
) -> list[str]:
    """Change some fields of one model config; the rest stay. Returns the fields that changed."""
    stored = models.to_public(db, models.get_model(db, name)).model_dump(mode="json")
    fields = {k: v for k, v in stored.items() if k not in _STAMPS}
    unknown = sorted(set(changes) - set(fields))
    if unknown:
        import difflib

        hints = [
            f"{u} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(u, fields, 1)) else u for u in unknown
        ]
        raise Invalid(f"no such field: {', '.join(hints)}", field=unknown[0])
    try:
        update = ModelConfigUpdate.model_validate({**fields, **changes})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "input"
        raise Invalid(f"{where}: {first['msg']}", field=where) from exc
    models.replace_model(db, name, update, rules=rules)
    return [k for k in changes if changes[k] != fields[k]]
