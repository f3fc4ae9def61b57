"""`vllm-manager keys create|list|set|revoke|open-v1` and `vllm-manager usage`: inference keys for /v1 (and
their limits) and what they used, straight in the store (as `token create`), so keys can be made before
the manager runs; a running manager counts by a key's new limits from its next request on."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer

from manager.cli_audit import audited
from manager.cli_common import DataDir, fail, open_db, run, settings_for, validation_message

keys_app = typer.Typer(help="Inference API keys for /v1 (separate from the admin token).", no_args_is_help=True)

RELATIVE = re.compile(r"^(\d+)([mhd])$")
UNITS = {"m": "minutes", "h": "hours", "d": "days"}


NO_LIMIT = "none"
Rpm = Annotated[str | None, typer.Option("--rpm", help="Requests per minute ('none': no limit).")]
Tpm = Annotated[str | None, typer.Option("--tpm", help="Tokens (prompt and completion) per minute.")]
MaxConcurrent = Annotated[str | None, typer.Option("--max-concurrent", help="Requests in flight at once.")]
TokenBudget = Annotated[str | None, typer.Option("--token-budget", help="Tokens per --budget-period.")]
BudgetPeriod = Annotated[str | None, typer.Option("--budget-period", help="day or month (UTC; default month).")]
Expires = Annotated[
    str | None, typer.Option("--expires", help="When the key stops working: 30d, 12h, or an ISO date/time (UTC).")
]
Priority = Annotated[
    str | None, typer.Option("--priority", help="interactive (default), or batch: waits behind interactive requests.")
]


def _limits(**given: str | None) -> dict[str, Any]:
    """The limit options given, as the API takes them: 'none' is no limit; the schema checks the rest."""
    out: dict[str, Any] = {}
    for field, text in given.items():
        if text is None:
            continue
        value = text.strip()
        if value.lower() == NO_LIMIT:
            out[field] = None
        elif field == "expires_at":
            out[field] = _expiry(value)
        else:
            out[field] = value
    return out


def _expiry(text: str) -> str:
    found = RELATIVE.match(text)
    if found:
        return (datetime.now(UTC) + timedelta(**{UNITS[found.group(2)]: int(found.group(1))})).isoformat()
    return text


@keys_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="A label: who or what uses the key.")],
    models: Annotated[
        str | None, typer.Option("--models", help="Model configs it may use, comma separated (default: all).")
    ] = None,
    rpm: Rpm = None,
    tpm: Tpm = None,
    max_concurrent: MaxConcurrent = None,
    token_budget: TokenBudget = None,
    budget_period: BudgetPeriod = None,
    expires: Expires = None,
    priority: Priority = None,
    data_dir: DataDir = None,
) -> None:
    """Make a key, with limits if given (none by default). It is printed once; only its hash is stored."""
    from pydantic import ValidationError

    from manager.schemas.inference_key import InferenceKeyCreate
    from manager.services import inference_keys

    names = [m.strip() for m in (models or "").split(",") if m.strip()]
    limits = _limits(
        rpm=rpm,
        tpm=tpm,
        max_concurrent=max_concurrent,
        token_budget=token_budget,
        budget_period=budget_period,
        expires_at=expires,
        priority=priority,
    )
    try:
        data = InferenceKeyCreate(name=name, models=names, **{k: v for k, v in limits.items() if v is not None})
    except ValidationError as exc:
        fail(validation_message(exc))
    with open_db(settings_for(data_dir)) as db:
        created = audited(db, "keys create", "keys.create", data.name, inference_keys.create_key, db, data)
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
        if k.expired and not k.revoked_at:
            state = "expired"
        typer.echo(
            f"{k.name:<20} {k.prefix}...  {','.join(k.models) or 'all models':<24} "
            f"made {_when(k.created_at)}  {used:<16}  {state:<8}  {_limits_line(k)}"
        )
    typer.secho(access.message, err=True)


def _limits_line(key) -> str:
    parts = [
        f"{label} {value}"
        for label, value in (
            ("rpm", key.rpm),
            ("tpm", key.tpm),
            ("max_concurrent", key.max_concurrent),
            (f"tokens/{key.budget_period}", key.token_budget),
        )
        if value is not None
    ]
    if key.expires_at is not None:
        parts.append(f"expires {_when(key.expires_at)}")
    if key.priority != "interactive":
        parts.append(key.priority)
    return ", ".join(parts) or "no limits"


@keys_app.command("set")
def set_(
    name: Annotated[str, typer.Argument(help="The active key's name.")],
    rpm: Rpm = None,
    tpm: Tpm = None,
    max_concurrent: MaxConcurrent = None,
    token_budget: TokenBudget = None,
    budget_period: BudgetPeriod = None,
    expires: Expires = None,
    priority: Priority = None,
    data_dir: DataDir = None,
) -> None:
    """Change a key's limits, expiry or priority: the options given change ('none': no limit), the others stay."""
    from pydantic import ValidationError

    from manager.schemas.inference_key import KeyLimitsUpdate
    from manager.services import inference_keys

    limits = _limits(
        rpm=rpm,
        tpm=tpm,
        max_concurrent=max_concurrent,
        token_budget=token_budget,
        budget_period=budget_period,
        expires_at=expires,
        priority=priority,
    )
    if not limits:
        fail(
            "give at least one of --rpm, --tpm, --max-concurrent, --token-budget, --budget-period, --expires, --priority"
        )
    try:
        data = KeyLimitsUpdate(**limits)
    except ValidationError as exc:
        fail(validation_message(exc))
    with open_db(settings_for(data_dir)) as db:
        key = audited(db, "keys set", "keys.update", name, inference_keys.set_limits, db, name, data)
        typer.echo(f"{key.name}: {_limits_line(inference_keys.to_public(key))}")


@keys_app.command("revoke")
def revoke(name: str, data_dir: DataDir = None) -> None:
    """Revoke the active key of this name: /v1 refuses it at once; its usage stays."""
    from manager.services import inference_keys

    with open_db(settings_for(data_dir)) as db:
        audited(db, "keys revoke", "keys.delete", name, inference_keys.revoke_key, db, name)
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
        access = audited(db, "keys open-v1", "v1-access.open", None, inference_keys.open_without_keys, db)
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
