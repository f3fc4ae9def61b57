"""`vllm-manager token create|list|revoke|rotate` and `vllm-manager sessions list|revoke`: the admin
tokens and the browser sessions made with them, straight in the store, so they work whether or not
the manager runs (a running one checks both on every request)."""

from __future__ import annotations

from typing import Annotated

import typer

from manager.cli_audit import audited
from manager.cli_common import DataDir, fail, open_db, settings_for

token_app = typer.Typer(help="Admin API tokens.", no_args_is_help=True)
sessions_app = typer.Typer(help="Browser sessions from the login page.", no_args_is_help=True)

STORE_IT = (
    "Store it now: it is not shown again. Send it as 'Authorization: Bearer <token>', "
    "or enter it on the dashboard's login page (/login)."
)
TokenRef = Annotated[str, typer.Argument(help="The token's id (`vllm-manager token list`), or its name.")]


@token_app.command("create")
def create(
    name: Annotated[str, typer.Option(help="A label for the token.")] = "default", data_dir: DataDir = None
) -> None:
    """Create an API token. It is printed once; only its hash is stored."""
    from manager.services import tokens

    with open_db(settings_for(data_dir)) as db:
        token = audited(db, "token create", "tokens.create", name, tokens.create_token, db, name)
    typer.echo(token)
    typer.secho(STORE_IT, err=True)


@token_app.command("list")
def list_(data_dir: DataDir = None) -> None:
    """The stored tokens: id, name, when made (never the token itself)."""
    from manager.services import tokens

    with open_db(settings_for(data_dir)) as db:
        stored = tokens.list_tokens(db)
    for token in stored:
        typer.echo(f"{token.id:<6} {token.name:<24} made {token.created_at:%Y-%m-%d %H:%M} UTC")
    if not stored:
        typer.secho("No stored tokens (VLLM_MANAGER_API_TOKEN, where set, is not stored).", err=True)


@token_app.command("revoke")
def revoke(
    token: TokenRef,
    last: Annotated[bool, typer.Option("--last", help="Revoke it even when it is the last stored token.")] = False,
    data_dir: DataDir = None,
) -> None:
    """Delete a token: it stops working at once, and every browser session it logged in ends."""
    from manager.services import tokens

    with open_db(settings_for(data_dir)) as db:
        gone, ended = audited(db, "token revoke", "tokens.revoke", token, tokens.revoke_token, db, token, last)
    typer.echo(f"revoked token {gone.id} ({gone.name}); {_sessions(ended)} ended")


@token_app.command("rotate")
def rotate(token: TokenRef, data_dir: DataDir = None) -> None:
    """Replace a token with a new one of the same name: the old one stops working at once, and every
    browser session it logged in ends. The new token is printed once."""
    from manager.services import tokens

    with open_db(settings_for(data_dir)) as db:
        new, old, ended = audited(db, "token rotate", "tokens.rotate", token, tokens.rotate_token, db, token)
    typer.echo(new)
    typer.secho(f"Token {old.id} ({old.name}) no longer works; {_sessions(ended)} ended. {STORE_IT}", err=True)


@sessions_app.command("list")
def sessions_list(data_dir: DataDir = None) -> None:
    """Browser sessions not yet expired, the most recently used first."""
    from manager.auth import sessions
    from manager.schemas.common import utcnow
    from manager.services import tokens

    with open_db(settings_for(data_dir)) as db:
        names = tokens.names_by_digest(db)
        shown = [sessions.to_public(row, names) for row in sessions.live(db, utcnow())]
    for s in shown:
        typer.echo(
            f"{s.id:<6} {s.token:<24} {s.client_address:<16} last seen {s.last_seen_at:%Y-%m-%d %H:%M}  "
            f"made {s.created_at:%Y-%m-%d %H:%M}  ends {s.expires_at:%Y-%m-%d %H:%M}  {s.user_agent}"
        )
    if not shown:
        typer.secho("No browser sessions.", err=True)


@sessions_app.command("revoke")
def sessions_revoke(
    session_id: Annotated[
        int | None, typer.Argument(min=1, max=2**63 - 1, help="The session's id (`vllm-manager sessions list`).")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="End every browser session.")] = False,
    data_dir: DataDir = None,
) -> None:
    """End a browser session (or all): its browser must log in again."""
    from manager.auth import sessions

    if (session_id is None) == (not all_):
        fail("name one session by its id, or pass --all (not both)")
    with open_db(settings_for(data_dir)) as db:
        if all_:
            ended = audited(db, "sessions revoke --all", "sessions.delete", None, sessions.end_all, db)
        else:
            audited(db, "sessions revoke", "sessions.delete", str(session_id), sessions.end_by_id, db, session_id)
            ended = 1
    typer.echo(f"{_sessions(ended)} ended")


def _sessions(count: int) -> str:
    return f"{count} browser session{'' if count == 1 else 's'}"
