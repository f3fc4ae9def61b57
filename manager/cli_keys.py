"""`vllm-manager keys create|list|revoke|open-v1` and `vllm-manager usage`: inference keys for /v1 and what
they used, straight in the store (as `token create`), so keys can be made before the manager runs."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer

from manager.cli_common import DataDir, fail, open_db, run, settings_for, validation_message

keys_app = typer.Typer(help="Inference API keys for /v1 (separate from the admin token).", no_args_is_help=True)

RELATIVE = re.compile(r"^(\d+)([mhd])$")
UNITS = {"m": "minutes", "h": "hours", "d": "days"}


@keys_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="A label: who or what uses the key.")],
    models: Annotated[
        str | None, typer.Option("--models", help="Model configs it may use, comma separated (default: all).")
    ] = None,
    data_dir: DataDir = None,
) -> None:
    """Make a key. It is printed once; only its hash is stored."""
    from pydantic import ValidationError

    from manager.schemas.inference_key import InferenceKeyCreate
    from manager.services import inference_keys

    names = [m.strip() for m in (models or "").split(",") if m.strip()]
    try:
        data = InferenceKeyCreate(name=name, models=names)
    except ValidationError as exc:
        fail(validation_message(exc))
    with open_db(settings_for(data_dir)) as db:
        created = run(inference_keys.create_key, db, data)
    typer.echo(created.key)
    typer.secho(
        f"Store it now: it is not shown again. Clients send it as 'Authorization: Bearer <key>' "
        f"(the OpenAI clients' api_key); it may use {', '.join(created.models) or 'every model'}.",
        err=True,
    )


@keys_app.command("list")
def list_(data_dir: DataDir = None) -> None:
    """Every key: name, first characters, models, when made and last used; revoked ones last."""
    from manager.services import inference_keys

    with open_db(settings_for(data_dir)) as db:
        keys = [inference_keys.to_public(k) for k in inference_keys.list_keys(db)]
        access = inference_keys.access_now(db)
    for k in keys:
        used = _when(k.last_used_at) if k.last_used_at else "never used"
        state = f"revoked {_when(k.revoked_at)}" if k.revoked_at else "active"
        typer.echo(
            f"{k.name:<20} {k.prefix}...  {','.join(k.models) or 'all models':<24} "
            f"made {_when(k.created_at)}  {used:<16}  {state}"
        )
    typer.secho(access.message, err=True)


@keys_app.command("revoke")
def revoke(name: str, data_dir: DataDir = None) -> None:
    """Revoke the active key of this name: /v1 refuses it at once; its usage stays."""
    from manager.services import inference_keys

    with open_db(settings_for(data_dir)) as db:
        run(inference_keys.revoke_key, db, name)
        last = not inference_keys.any_active(db)
    typer.echo(f"revoked {name}")
    if last:
        typer.secho(
            "That was the last active key: /v1 stays closed to callers without a key until you make a new one "
            "or open it with `vllm-manager keys open-v1`.",
            err=True,
        )


@keys_app.command("open-v1")
def open_v1(data_dir: DataDir = None) -> None:
    """Let /v1 be used without a key again, as before any key was made. Once a key was made, revoking
    the last one leaves /v1 closed; this opens it (refused while a key is active)."""
    from manager.services import inference_keys

    with open_db(settings_for(data_dir)) as db:
        access = run(inference_keys.open_without_keys, db)
    typer.echo(access.message)


def usage(
    since: Annotated[
        str | None, typer.Option(help="From when: 30m, 6h, 7d, or an ISO date (default: a span that suits --per).")
    ] = None,
    per: Annotated[str, typer.Option(help="minute, hour or day.")] = "hour",
    model: Annotated[str | None, typer.Option(help="Only this model config.")] = None,
    key: Annotated[str | None, typer.Option(help="Only this key's name; '-' for requests without a key.")] = None,
    data_dir: DataDir = None,
) -> None:
    """Requests and tokens through /v1 per key and model (the last few seconds are written a moment later)."""
    from manager.services import usage as usage_store

    start = _since(since) if since else None
    with open_db(settings_for(data_dir)) as db:
        report = run(usage_store.report, db, since=start, per=per, model=model, key=key)
    typer.echo(f"{report.since:%Y-%m-%d %H:%M} to {report.until:%Y-%m-%d %H:%M} UTC, per {report.per}")
    header = f"{'':<17} {'key':<20} {'model':<24} {'requests':>9} {'errors':>7} {'prompt':>10} {'completion':>11}"
    typer.echo(header)
    for line in report.rows:
        typer.echo(_line(f"{line.start:%Y-%m-%d %H:%M}" if line.start else "", line))
    for line in report.totals:
        typer.echo(_line("total", line))
    t = report.total
    typer.echo(
        f"{'all':<17} {'':<20} {'':<24} {t.requests:>9} {t.errors:>7} {t.prompt_tokens:>10} {t.completion_tokens:>11}"
    )


def _line(label: str, line) -> str:
    key = line.key or "(no key)"
    return (
        f"{label:<17} {key:<20} {line.model:<24} {line.requests:>9} {line.errors:>7} "
        f"{line.prompt_tokens:>10} {line.completion_tokens:>11}"
    )


def _since(text: str) -> datetime:
    found = RELATIVE.match(text.strip())
    if found:
        return datetime.now(UTC) - timedelta(**{UNITS[found.group(2)]: int(found.group(1))})
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        fail(f"--since takes 30m, 6h, 7d or an ISO date such as 2026-05-01T12:00, not {text!r}")


def _when(at: datetime) -> str:
    return f"{at:%Y-%m-%d %H:%M}"
