"""`vllm-manager apply FILE`, `models set NAME field=value ...` and `models edit NAME`: edit stored configs."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from manager.cli_audit import audited
from manager.cli_common import DataDir, fail, open_db, read_bytes, run, settings_for


def apply(
    file: Annotated[Path, typer.Argument(help="YAML with 'models:' and/or 'profiles:' lists (an export will do).")],
    prune: Annotated[bool, typer.Option("--prune", help="Also delete stored items the file does not name.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Make the stored model configs and offload profiles equal to a file, and print what changed."""
    from manager.services.apply import apply_data, read_file
    from manager.services.models import WriteRules

    settings = settings_for(data_dir)
    raw = read_bytes(file)
    with open_db(settings) as db:
        data = run(read_file, raw)
        result = audited(db, "apply", "apply", None, apply_data, db, data, prune=prune, rules=WriteRules.of(settings))
    for word, items in (("created", result.created), ("changed", result.changed), ("removed", result.removed)):
        for item in items:
            typer.echo(f"{word:<9} {item}")
    typer.echo(
        f"{len(result.created)} created, {len(result.changed)} changed, {len(result.removed)} removed, "
        f"{len(result.unchanged)} unchanged"
    )


def models_set(
    name: str,
    changes: Annotated[
        list[str], typer.Argument(help="field=value pairs; values are YAML (2048, true, [a, b], null).")
    ],
    data_dir: DataDir = None,
) -> None:
    """Change some fields of a model config, keeping the others."""
    import yaml

    from manager.services.apply import set_fields
    from manager.services.models import WriteRules

    parsed: dict[str, Any] = {}
    for change in changes:
        field, eq, text = change.partition("=")
        if not eq or not field:
            fail(f"{change!r} is not field=value (for example max_model_len=8192)")
        try:
            parsed[field.strip()] = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as exc:
            fail(f"the value of {field} is not valid YAML: {exc}")
    settings = settings_for(data_dir)
    with open_db(settings, reading=True) as db:
        changed = audited(
            db, "models set", "models.update", name, set_fields, db, name, parsed, rules=WriteRules.of(settings)
        )
    typer.echo(f"model config {name}: {', '.join(changed) + ' changed' if changed else 'nothing changed'}")


def models_edit(name: str, data_dir: DataDir = None) -> None:
    """Open a model config in $EDITOR (or $VISUAL, else vi) as YAML, and save it when it is valid."""
    import yaml

    from manager.services import models
    from manager.services.apply import set_fields
    from manager.services.models import WriteRules

    settings = settings_for(data_dir)
    with open_db(settings, reading=True) as db:
        stored = run(lambda: models.to_public(db, models.get_model(db, name))).model_dump(mode="json")
    fields = {k: v for k, v in stored.items() if k not in ("name", "created_at", "updated_at")}
    editor = shlex.split(os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=f"{name}-", delete=False) as fh:
        fh.write(f"# model config {name}: save and quit to store it; its name stays\n")
        yaml.safe_dump(fields, fh, sort_keys=False, allow_unicode=True)
        path = Path(fh.name)
    try:
        if subprocess.run([*editor, str(path)]).returncode != 0:
            fail(f"the editor ({editor[0]}) failed: nothing was saved")
        try:
            edited = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            fail(f"the file is not valid YAML: {exc}; nothing was saved")
        if not isinstance(edited, dict):
            fail("the file must hold the config's fields as a mapping; nothing was saved")
        with open_db(settings, reading=True) as db:
            changed = audited(
                db, "models edit", "models.update", name, set_fields, db, name, edited, rules=WriteRules.of(settings)
            )
    finally:
        path.unlink(missing_ok=True)
    typer.echo(f"model config {name}: {', '.join(changed) + ' changed' if changed else 'nothing changed'}")
