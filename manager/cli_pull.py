"""`vllm-manager pull REPO`: download a model from the Hugging Face Hub into the cache the engines read,
through the running manager, with a progress bar (bytes, rate, time left)."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer

from manager.cli_workers import Token, Url, call

GiB = 1024**3
POLL_S = 0.5


def pull(
    repo: Annotated[str, typer.Argument(help="A Hugging Face model id, such as Qwen/Qwen3-0.6B.")],
    revision: Annotated[str | None, typer.Option("--revision", help="Branch, tag or commit (default: main).")] = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="Start the download and return; `vllm-manager downloads` follows it.")
    ] = False,
    url: Url = None,
    token: Token = None,
) -> None:
    """Download the files vLLM loads for a model (safetensors weights, config, tokenizer), checked against
    the cache disk's free space first. Ctrl-C cancels it; pulling again goes on from the bytes on disk."""
    body = {"repo": repo, **({"revision": revision} if revision else {})}
    row = call(url, token, "POST", "/api/downloads", json=body)
    typer.echo(
        f"{repo} at {row['commit'][:12] if row.get('commit') else row['revision']}: {row['files']} files, "
        f"{row['total_bytes'] / GiB:.2f} GiB into {row['cache_dir']}",
        err=True,
    )
    if detach:
        typer.echo(f"download {row['id']} runs in the manager", err=True)
        return
    try:
        row = _follow(url, token, row)
    except KeyboardInterrupt:
        row = call(url, token, "POST", f"/api/downloads/{row['id']}/cancel")
        typer.secho(
            f"cancelled at {row['done_bytes'] / GiB:.2f} of {row['total_bytes'] / GiB:.2f} GiB: "
            f"`vllm-manager pull {repo}` goes on from there",
            fg="yellow",
            err=True,
        )
        raise typer.Exit(130) from None
    if row["state"] != "done":
        typer.secho(f"the download of {repo} {row['state']}: {row.get('error') or ''}", fg="red", err=True)
        raise typer.Exit(1)
    typer.echo(f"downloaded {repo} ({row['total_bytes'] / GiB:.2f} GiB) into {row['cache_dir']}")


def _follow(url: str | None, token: str | None, row: dict) -> dict:
    """Poll the download until it ends, drawing its progress (a bar on a terminal, a line a second elsewhere)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    last_line = 0.0
    with Progress(*columns, transient=False, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(row["repo"], total=row["total_bytes"] or None, completed=row["done_bytes"])
        while row["state"] in ("queued", "running"):
            time.sleep(POLL_S)
            row = call(url, token, "GET", f"/api/downloads/{row['id']}")
            bar.update(task, completed=row["done_bytes"])
            now = time.monotonic()
            if not sys.stderr.isatty() and now - last_line >= 1.0:
                last_line = now
                rate = f", {row['rate_bps'] / 1024**2:.1f} MiB/s" if row.get("rate_bps") else ""
                left = f", {row['eta_s']:.0f} s left" if row.get("eta_s") is not None else ""
                typer.echo(f"{row['percent']:3d} %  {row['done_bytes'] / GiB:.2f} GiB{rate}{left}", err=True)
    return row


def downloads(url: Url = None, token: Token = None) -> None:
    """Downloads under way and the latest finished ones."""
    for row in call(url, token, "GET", "/api/downloads"):
        rate = f" {row['rate_bps'] / 1024**2:.1f} MiB/s" if row.get("rate_bps") else ""
        typer.echo(
            f"{row['id']:>4}  {row['state']:<9} {row['percent']:3d} %  {row['total_bytes'] / GiB:7.2f} GiB{rate}  "
            f"{row['repo']}  {row.get('error') or ''}"
        )
