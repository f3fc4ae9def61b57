"""Export every model config and offload profile as one YAML document, and import it back."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from manager.errors import Conflict, Invalid
from manager.hub.model_location import check_path_exists
from manager.launch.refusals import check_launch_fields
from manager.schemas.model_config import ModelConfig, ModelConfigCreate
from manager.schemas.offload_profile import OffloadProfile, OffloadProfileCreate
from manager.services import models, profiles, routing_names

FORMAT_VERSION = 1
_STAMPS = {"created_at", "updated_at"}


def export_data(db: Session) -> dict[str, Any]:
    return {
        "format": "vllm-manager",
        "version": FORMAT_VERSION,
        "profiles": [
            profiles.to_public(p).model_dump(mode="json", exclude=_STAMPS) for p in profiles.list_profiles(db)
        ],
        "models": [models.to_public(db, m).model_dump(mode="json", exclude=_STAMPS) for m in models.list_models(db)],
    }


def export_yaml(db: Session) -> str:
    return yaml.safe_dump(export_data(db), sort_keys=False, allow_unicode=True)


def parse_yaml(source: str | bytes) -> dict[str, Any]:
    """An export file's contents (bytes must be UTF-8), checked to be one; Invalid says what is wrong."""
    if isinstance(source, bytes):
        try:
            source = source.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Invalid(
                f"the file is not UTF-8 text (byte 0x{source[exc.start]:02x} at offset {exc.start}): "
                "save it as UTF-8 and import it again"
            ) from exc
    try:
        data = yaml.safe_load(source)
    except yaml.YAMLError as exc:
        raise Invalid(f"the file is not valid YAML: {exc}") from exc
    except RecursionError as exc:  # PyYAML composes nested collections recursively
        raise Invalid(
            "the file is nested too deeply to read (hundreds of levels; an export has four): "
            "check that it is a vllm-manager export"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != "vllm-manager":
        raise Invalid("not a vllm-manager export: the top level needs format: vllm-manager")
    if data.get("version") != FORMAT_VERSION:
        raise Invalid(f"export version {data.get('version')!r} is not supported (expected {FORMAT_VERSION})")
    return data


def import_file(
    db: Session,
    source: str | bytes,
    *,
    overwrite: bool = True,
    rules: models.WriteRules = models.WriteRules(),
) -> dict[str, list[str]]:
    """Parse, check and store an export file: ``parse_yaml`` then ``import_data``. A large file takes
    seconds to parse; the web layer calls this in a worker thread."""
    return import_data(db, parse_yaml(source), overwrite=overwrite, rules=rules)


def _validated(kind: str, schema, items: Any) -> list:
    if not isinstance(items, list):
        raise Invalid(f"{kind} must be a list")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(schema.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise Invalid(f"{kind}[{i}].{where}: {first['msg']}", field=f"{kind}[{i}].{where}") from exc
    return out


def import_data(
    db: Session,
    data: dict[str, Any],
    *,
    overwrite: bool = True,
    rules: models.WriteRules = models.WriteRules(),
) -> dict[str, list[str]]:
    """Create or (with overwrite) replace every profile and config in one transaction.

    Everything is validated before anything is written, so a bad file changes nothing, by the same
    ``rules`` as a config written on its own.
    """
    new_profiles = _validated("profiles", OffloadProfileCreate, data.get("profiles", []))
    new_models = _validated("models", ModelConfigCreate, data.get("models", []))
    known_profiles = {p.name for p in new_profiles} | {p.name for p in profiles.list_profiles(db)}
    for i, m in enumerate(new_models):
        if m.offload_profile and m.offload_profile not in known_profiles:
            raise Invalid(
                f"models[{i}] names offload profile {m.offload_profile!r}, which is neither stored nor in the file"
            )
        try:
            if rules.local_paths:
                check_path_exists(m.model)
            check_launch_fields(m.extra_args, m.env, rules.allow_code_flags)
        except Invalid as exc:
            raise Invalid(f"models[{i}] ({m.name}): {exc.message}", **exc.detail) from None
    for kind, items in (("profiles", new_profiles), ("models", new_models)):
        names = [item.name for item in items]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise Invalid(f"{kind}: {', '.join(repeated)} appear more than once in the file")
    if not overwrite:
        clashes = [p.name for p in new_profiles if _exists(db, OffloadProfile, p.name)]
        clashes += [m.name for m in new_models if _exists(db, ModelConfig, m.name)]
        if clashes:
            raise Conflict(f"already stored: {', '.join(clashes)} (import with overwrite to replace them)")
    clash = routing_names.name_clash((m.name, m.served_model_name, m.aliases) for m in new_models)
    if clash:
        raise Conflict(f"import refused: {clash}")

    # A name another client stores between our reads and our commit breaks a UNIQUE constraint: with
    # overwrite, write once more (that name is replaced now); without, it is a clash like any other.
    # A name /v1 routes by that a config or adapter outside the file holds is refused either way.
    try:
        return _commit(db, new_profiles, new_models, overwrite)
    except IntegrityError as exc:
        _refuse_names_held(db, new_models, exc)
        if not overwrite:
            raise Conflict(_STORED_MEANWHILE) from exc
    try:
        return _commit(db, new_profiles, new_models, overwrite)
    except IntegrityError as exc:
        _refuse_names_held(db, new_models, exc)
        raise Conflict(_STORED_MEANWHILE) from exc


_STORED_MEANWHILE = (
    "some of these names were already stored by another client while this import ran; nothing was imported: "
    "import again (with overwrite to replace them)"
)


def _commit(
    db: Session, new_profiles: list[OffloadProfileCreate], new_models: list[ModelConfigCreate], overwrite: bool
) -> dict[str, list[str]]:
    try:
        result = _write(db, new_profiles, new_models, overwrite)
        db.commit()
    except Exception:
        db.rollback()
        raise
    return result


def _write(
    db: Session, new_profiles: list[OffloadProfileCreate], new_models: list[ModelConfigCreate], overwrite: bool
) -> dict[str, list[str]]:
    """Add or replace every item in the session; the caller commits. Without overwrite, a name that
    another client stored since the clash check is a Conflict."""
    result: dict[str, list[str]] = {"created": [], "replaced": []}
    for p in new_profiles:
        stored_profile = db.exec(select(OffloadProfile).where(OffloadProfile.name == p.name)).first()
        if stored_profile is None:
            db.add(OffloadProfile.model_validate(p.model_dump()))
            result["created"].append(f"profile {p.name}")
        elif not overwrite:
            raise Conflict(_STORED_MEANWHILE)
        else:
            for key, value in p.model_dump(exclude={"name"}).items():
                setattr(stored_profile, key, value)
            db.add(stored_profile)
            result["replaced"].append(f"profile {p.name}")
    db.flush()
    configs: list[ModelConfig] = []
    for m in new_models:
        fields = m.model_dump(exclude={"name", "offload_profile"})
        fields["offload_profile_id"] = (
            db.exec(select(OffloadProfile.id).where(OffloadProfile.name == m.offload_profile)).first()
            if m.offload_profile
            else None
        )
        stored_model = db.exec(select(ModelConfig).where(ModelConfig.name == m.name)).first()
        if stored_model is None:
            stored_model = ModelConfig(name=m.name, **fields)
            result["created"].append(f"model {m.name}")
        elif not overwrite:
            raise Conflict(_STORED_MEANWHILE)
        else:
            for key, value in fields.items():
                setattr(stored_model, key, value)
            result["replaced"].append(f"model {m.name}")
        db.add(stored_model)
        configs.append(stored_model)
    db.flush()
    # Every config's old names are let go before any takes its new ones: a file may move an alias
    # from one of its configs to another.
    for config in configs:
        routing_names.release_config_names(db, config)
    for config in configs:
        routing_names.hold_config_names(db, config)
    return result


def _refuse_names_held(db: Session, new_models: list[ModelConfigCreate], exc: IntegrityError) -> None:
    """Conflict naming the first name of the file that a config or adapter outside it holds, if one does."""
    incoming = [m.name for m in new_models]
    for m in new_models:
        refusal = routing_names.taken(db, routing_names.routing_names(m.name, m.served_model_name, m.aliases), incoming)
        if refusal is not None:
            raise Conflict(f"import refused: {refusal.message}", **refusal.detail) from exc


def _exists(db: Session, table, name: str) -> bool:
    return db.exec(select(table.id).where(table.name == name)).first() is not None
