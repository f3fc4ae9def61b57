"""`vllm-manager start|stop|restart|switch|ps|logs`: talk to the running manager over its API."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

from manager.address import DEFAULT_PORT

if TYPE_CHECKING:
    import httpx

Url = Annotated[
    str | None,
    typer.Option("--url", help="The manager's address (default http://127.0.0.1:7999, or $VLLM_MANAGER_URL)."),
]
Token = Annotated[str | None, typer.Option("--token", help="API token (default $VLLM_MANAGER_API_TOKEN).")]


def _client(url: str | None, token: str | None) -> httpx.Client:
    import httpx

    base = (
        url
        or os.environ.get("VLLM_MANAGER_URL")
        or f"http://127.0.0.1:{os.environ.get('VLLM_MANAGER_PORT', DEFAULT_PORT)}"
    )
    token = token or os.environ.get("VLLM_MANAGER_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(60, read=600))


def call(url, token, method: str, path: str, **kwargs):
    import httpx

    try:
        with _client(url, token) as client:
            resp = client.request(method, path, **kwargs)
    except httpx.TransportError as exc:
        typer.secho(f"cannot reach the manager ({exc}); is `vllm-manager serve` running?", fg="red", err=True)
        raise typer.Exit(2) from exc
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        if resp.status_code == 401:
            given = "the token given was not accepted" if token or os.environ.get("VLLM_MANAGER_API_TOKEN") else None
            detail = (
                f"{given or 'this manager needs its API token'}: pass --token TOKEN or set VLLM_MANAGER_API_TOKEN "
                "(`vllm-manager token create` on the manager's machine makes one)"
            )
        typer.secho(f"{resp.status_code}: {detail}", fg="red", err=True)
        raise typer.Exit(1)
    return resp.json() if resp.content else None


PS_HEADER = f"{'id':>3}  {'state':<9} {'model':<24} {'port':<11} {'pid':<12} {'up':<10} restarts  detail"


def _line(w: dict) -> str:
    up = f"{w['uptime_s']:.0f}s" if w.get("uptime_s") is not None else "-"
    extra = w.get("last_error") or w.get("detail") or ""
    return f"{w['id']:>3}  {w['state']:<9} {w['model']:<24} port {w['port'] or '-':<6} pid {w['pid'] or '-':<8} up {up:<7} restarts {w['restart_count']}  {extra}"


def register(app: typer.Typer) -> None:
    @app.command()
    def start(
        model: str,
        gpus: Annotated[str | None, typer.Option(help="GPU ids, e.g. 0,1")] = None,
        port: Annotated[int | None, typer.Option()] = None,
        force: Annotated[bool, typer.Option(help="Start even if the memory plan says it will not fit.")] = False,
        url: Url = None,
        token: Token = None,
    ) -> None:
        """Start a worker for a model config."""
        body: dict[str, object] = {"model": model, "port": port, "force": force}
        if gpus:
            body["gpus"] = [int(g) for g in gpus.split(",")]
        typer.echo(_line(call(url, token, "POST", "/api/workers", json=body)))

    @app.command()
    def stop(worker: int, url: Url = None, token: Token = None) -> None:
        """Stop a worker (SIGTERM, grace period, SIGKILL)."""
        typer.echo(_line(call(url, token, "POST", f"/api/workers/{worker}/stop")))

    @app.command()
    def restart(worker: int, url: Url = None, token: Token = None) -> None:
        """Restart a worker."""
        typer.echo(_line(call(url, token, "POST", f"/api/workers/{worker}/restart")))

    @app.command()
    def switch(worker: int, model: str, url: Url = None, token: Token = None) -> None:
        """Switch a worker to another model config (rolls back if the new one does not start)."""
        typer.echo(_line(call(url, token, "POST", f"/api/workers/{worker}/switch", json={"model": model})))

    @app.command()
    def ps(
        all_: Annotated[bool, typer.Option("--all", help="Also list vLLM servers the manager did not start.")] = False,
        url: Url = None,
        token: Token = None,
    ) -> None:
        """List workers."""
        typer.echo(PS_HEADER)
        for w in call(url, token, "GET", "/api/workers"):
            typer.echo(_line(w))
        if all_:
            for u in call(url, token, "GET", "/api/workers/unmanaged"):
                typer.echo(f"  -  unmanaged model {u['model']} port {u['port']} pid {u['pid']}")

    @app.command()
    def logs(
        worker: int,
        tail: Annotated[int, typer.Option()] = 100,
        follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
        url: Url = None,
        token: Token = None,
    ) -> None:
        """Show a worker's engine output."""
        if not follow:
            for line in call(url, token, "GET", f"/api/workers/{worker}/logs", params={"tail": tail})["lines"]:
                typer.echo(line)
            return
        with (
            _client(url, token) as client,
            client.stream("GET", f"/api/workers/{worker}/logs/stream", params={"tail": tail}, timeout=None) as resp,
        ):
            for raw in resp.iter_lines():
                if raw.startswith("data:"):
                    typer.echo(raw[5:].removeprefix(" "))

    del start, stop, restart, switch, ps, logs
