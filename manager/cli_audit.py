"""`vllm-manager audit`: the audit log of admin changes, straight from the store, newest first; and the
rows the CLI's own changes to the store leave there (configs, profiles, keys, admin tokens, sessions,
import and apply; the manager's API records its own)."""

from __future__ import annotations

import getpass
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from manager.cli_common import DataDir, fail, open_db, print_json, run, settings_for

if TYPE_CHECKING:
    from sqlmodel import Session

T = TypeVar("T")

RELATIVE = re.compile(r"^(\d{1,6})\s*([mhd])$")
UNITS = {"m": "minutes", "h": "hours", "d": "days"}


def audit(
    since: Annotated[str | None, typer.Option(help="From when: 30m, 6h, 7d, or an ISO date (UTC).")] = None,
    until: Annotated[str | None, typer.Option(help="Until when: 30m, 6h, 7d ago, or an ISO date (UTC).")] = None,
    who: Annotated[
        str | None,
        typer.Option(
            help="token:<id> (its calls and its sessions'), session:<id>, env-token, cli, anonymous or unauthenticated."
        ),
    ] = None,
    action: Annotated[str | None, typer.Option(help="An action (workers.stop), or a resource (workers).")] = None,
    outcome: Annotated[str | None, typer.Option(help="ok or failed.")] = None,
    limit: Annotated[int, typer.Option(help="The most rows to show (at most 1000).")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Who changed what, from where, and what came of it, newest first."""
    from manager.audit import store

    filters = store.Filters(
        since=_when(since, "--since"),
        until=_when(until, "--until"),
        who=who,
        action=action,
        outcome=outcome,
        limit=limit,
    )
    with open_db(settings_for(data_dir), reading=True) as db:
        page = run(store.find, db, filters)
    if as_json:
        print_json(page.model_dump(mode="json"))
        return
    typer.echo(f"{'when (UTC)':<19} {'who':<18} {'from':<15} {'action':<24} {'target':<20} {'status':>6}  message")
    for e in page.entries:
        who_text = e.who if e.token is None or e.token == e.who else f"{e.who} ({e.token})"
        typer.echo(
            f"{e.at:%Y-%m-%d %H:%M:%S} {who_text:<18} {e.address:<15} {e.action:<24} {e.target or '':<20} "
            f"{e.status:>6}  {e.message or ''}"
        )
    if not page.entries:
        typer.secho("No audit rows match.", err=True)
    elif page.more:
        typer.secho(f"More rows match: showing the newest {limit} (narrow the range, or raise --limit).", err=True)


def audited(db: Session, command: str, action: str, target: str | None, fn: Callable[..., T], *args, **kwargs) -> T:
    """Run a change to the store the way ``run`` does, and leave its audit row: done (with the stored
    fields it changed), or refused and why."""
    from manager.audit import changes, store
    from manager.audit.caller import Note
    from manager.errors import ManagerError
    from manager.schemas.audit import CLI, MAX_FIELDS, AuditEntry

    def row(status: int, message: str | None = None, changed: list[str] | None = None) -> AuditEntry:
        return AuditEntry(
            who=f"{CLI}:{_user()}", address="local", method="CLI", route=f"vllm-manager {command}",
            action=action, target=target, status=status, message=message, changed=changed or [],
        )  # fmt: skip

    note = Note()
    watching = changes.CURRENT.set(note)
    try:
        result = fn(*args, **kwargs)
    except ManagerError as exc:
        db.rollback()
        store.add(db, row(exc.status, exc.message))
        fail(exc.message)
    finally:
        changes.CURRENT.reset(watching)
    store.add(db, row(200, changed=sorted(note.changed)[:MAX_FIELDS]))
    return result


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _when(text: str | None, option: str) -> datetime | None:
    if text is None:
        return None
    found = RELATIVE.match(text.strip())
    if found:
        return datetime.now(UTC) - timedelta(**{UNITS[found.group(2)]: int(found.group(1))})
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        fail(f"{option} takes 30m, 6h, 7d or an ISO date such as 2026-05-01T12:00, not {text!r}")
