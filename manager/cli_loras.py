"""`vllm-manager loras list|add|rm|load|unload|pin`: LoRA adapters, through the running manager."""

from __future__ import annotations

from typing import Annotated

import typer

from manager.cli_workers import Token, Url, call

loras_app = typer.Typer(
    help="LoRA adapters: register them, load them into running workers, pin them.", no_args_is_help=True
)


def _line(a: dict) -> str:
    load = f"{a['last_load_s']:.2f}s" if a.get("last_load_s") is not None else "-"
    pin = "pinned" if a.get("pinned") else ""
    return f"{a['name']:<24} rank {a['rank']:<4} config {a['base_config']:<20} last load {load:<8} {pin}  {a['path']}"


@loras_app.command("list")
def list_(
    worker: Annotated[int | None, typer.Option(help="Show what this worker has loaded.")] = None,
    url: Url = None,
    token: Token = None,
) -> None:
    """List registered adapters, or one worker's loaded adapters and its CPU LoRA pool."""
    if worker is None:
        for adapter in call(url, token, "GET", "/api/loras"):
            typer.echo(_line(adapter))
        return
    info = call(url, token, "GET", f"/api/workers/{worker}/loras")
    typer.echo(f"worker {info['worker']} ({info['model_config']}):")
    for item in info["loaded"]:
        typer.echo(f"  loaded   {item['name']:<24} {item['path']}")
    for item in info["registered"]:
        if not item["loaded"]:
            typer.echo(f"  unloaded {item['name']:<24}{'  pinned' if item['pinned'] else ''}")
    if info.get("running") is not None:
        typer.echo(
            f"  running: {', '.join(info['running']) or '-'}   waiting: "
            f"{', '.join(info['waiting'] or []) or '-'}   max_loras: {info.get('max_loras')}"
        )
    pool = info.get("pool")
    if pool:
        typer.echo(
            f"  CPU LoRA pool: {pool.get('adapters_resident', 0):.0f} adapters, "
            f"{pool.get('used_bytes', 0) / 2**20:.1f} MiB used of "
            f"{pool.get('capacity_bytes', 0) / 2**20:.1f} MiB, hit rate "
            f"{pool.get('hit_rate', 0):.0%}, {pool.get('evictions', 0):.0f} evictions"
        )
    else:
        typer.echo(f"  CPU LoRA pool: {info.get('pool_note')}")


@loras_app.command()
def add(
    name: str,
    path: str,
    config: Annotated[str, typer.Option("--config", help="The model config it was trained for.")],
    pin: Annotated[bool, typer.Option("--pin", help="Keep it loaded in that config's workers.")] = False,
    url: Url = None,
    token: Token = None,
) -> None:
    """Register an adapter folder (checked: adapter_config.json, rank, target modules)."""
    result = call(
        url, token, "POST", "/api/loras", json={"name": name, "path": path, "base_config": config, "pinned": pin}
    )
    typer.echo(_line(result))
    if result.get("note"):
        typer.secho(f"note: {result['note']}", fg="yellow")


@loras_app.command()
def rm(name: str, url: Url = None, token: Token = None) -> None:
    """Remove an adapter from the registry (workers that loaded it keep it until unloaded)."""
    call(url, token, "DELETE", f"/api/loras/{name}")
    typer.echo(f"removed {name}")


@loras_app.command()
def load(worker: int, name: str, url: Url = None, token: Token = None) -> None:
    """Load a registered adapter into a running worker."""
    result = call(url, token, "POST", f"/api/workers/{worker}/loras/{name}/load")
    typer.echo(f"loaded {name} into worker {worker} in {result['load_s']:.2f}s")


@loras_app.command()
def unload(worker: int, name: str, url: Url = None, token: Token = None) -> None:
    """Unload an adapter from a running worker."""
    result = call(url, token, "POST", f"/api/workers/{worker}/loras/{name}/unload")
    typer.echo(f"unloaded {name} from worker {worker}")
    if result.get("note"):
        typer.secho(f"note: {result['note']}", fg="yellow")


@loras_app.command()
def pin(
    name: str,
    off: Annotated[bool, typer.Option("--off", help="Unpin instead.")] = False,
    url: Url = None,
    token: Token = None,
) -> None:
    """Pin an adapter: loaded now into ready workers of its config, and again after restarts."""
    result = call(url, token, "POST", f"/api/loras/{name}/pin", json={"pinned": not off})
    typer.echo(_line(result))
    if result.get("loaded_now"):
        typer.echo(f"loaded now: {', '.join(result['loaded_now'])}")
