"""The `vllm-manager` command line."""

from __future__ import annotations

import shlex
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from manager.address import DEFAULT_PORT, is_loopback
from manager.cli_common import (
    DataDir,
    fail,
    load_structured,
    open_db,
    print_json,
    read_bytes,
    run,
    settings_for,
    validation_message,
)

app = typer.Typer(help="Run and manage vLLM servers.", no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Model configs.", no_args_is_help=True)
profiles_app = typer.Typer(help="Offload profiles.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(profiles_app, name="profiles")


def _plan_command():
    from manager.cli_plan import plan

    return plan


def _register_worker_commands() -> None:
    from manager.cli_workers import register

    register(app)


_register_worker_commands()


def _register_lora_commands() -> None:
    from manager.cli_loras import loras_app

    app.add_typer(loras_app, name="loras", help="LoRA adapters: register, load on a worker, pin.")


_register_lora_commands()
app.command("plan", help="Plan memory for a model: what fits, why, and what would extend it.")(_plan_command())


@app.command()
def serve(
    host: Annotated[
        str | None,
        typer.Option(
            help="Address to bind (default 127.0.0.1, or VLLM_MANAGER_HOST). Public addresses need an API token."
        ),
    ] = None,
    port: Annotated[
        int | None, typer.Option(help=f"Port to listen on (default {DEFAULT_PORT}, or VLLM_MANAGER_PORT).")
    ] = None,
    data_dir: DataDir = None,
    open_reads: Annotated[
        bool,
        typer.Option(
            "--open-reads",
            help="Keep pages and reads open to anyone who reaches the manager; changes still need the token "
            "(or VLLM_MANAGER_OPEN_READS=1). Without it, once a token exists, reading needs it too.",
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="Run workers across a Ray cluster: 'auto' (the cluster this box joined with `ray start`) or the "
            "head's host:port (or VLLM_MANAGER_RAY_ADDRESS). Needs the 'cluster' extra. Unset: this box only.",
        ),
    ] = None,
    keep_workers: Annotated[
        bool,
        typer.Option(
            "--keep-workers",
            help="On Ctrl-C or SIGTERM leave the workers' engines running for the next manager to re-adopt "
            "(or VLLM_MANAGER_STOP_WORKERS_ON_EXIT=0). Without it a clean stop stops them first.",
        ),
    ] = False,
    forwarded_allow_ips: Annotated[
        str | None,
        typer.Option(
            help="Proxies in front of the manager whose X-Forwarded-For/-Proto headers are believed: addresses "
            "or networks, comma separated (or VLLM_MANAGER_FORWARDED_ALLOW_IPS). Default: none, so each client "
            "is known by the address it connects from.",
        ),
    ] = None,
) -> None:
    """Run the manager's web server and API."""
    import uvicorn
    from pydantic import ValidationError

    from manager.app import create_app
    from manager.services import tokens

    named = (("host", host), ("port", port), ("ray_address", ray_address), ("forwarded_allow_ips", forwarded_allow_ips))
    overrides: dict = {k: v for k, v in named if v}
    if open_reads:
        overrides["open_reads"] = True
    if keep_workers:
        overrides["stop_workers_on_exit"] = False
    try:
        settings = settings_for(data_dir, **overrides)
        _ = settings.env_token
    except ValidationError as exc:
        fail(validation_message(exc), code=2)
    except ValueError as exc:
        fail(str(exc), code=2)
    host, port = settings.host, settings.port
    # Opened here first so that an unusable data dir is one clear line and exit 2, not a traceback
    # from inside the server's startup.
    with open_db(settings) as db:
        has_token = tokens.auth_required(db, settings.env_token)
    if not is_loopback(host) and not has_token:
        fail(
            f"refusing to listen on {host} without an API token: anyone who can reach it could start "
            "processes. Create one with `vllm-manager token create` (or set VLLM_MANAGER_API_TOKEN), "
            "or bind 127.0.0.1.",
            code=2,
        )
    # The port is taken before anything else happens (the app's start adopts running engines):
    # a second manager on a port in use ends here, having touched nothing.
    listening = None if settings.forwarders else _take_port(host, port)
    if settings.ray_address:
        _join_cluster(settings.ray_address)
    app = create_app(settings, freeze_heap=True)
    if listening is None:
        from manager.frontdoor import forwarders

        forwarders.serve(app, settings)
        return
    config = uvicorn.Config(app, log_level="info", access_log=settings.access_log, **settings.proxy_header_options())
    uvicorn.Server(config).run(sockets=[listening])


def _take_port(host: str, port: int) -> socket.socket:
    """A socket bound to the manager's address, or exit 3 with what holds it."""
    from manager.frontdoor.forwarder import port_socket

    try:
        return port_socket(host, port, shared=False)
    except OSError as exc:
        fail(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}. Another program (another vllm-manager?) "
            "holds it: stop that one, or choose another --port (VLLM_MANAGER_PORT)",
            code=3,
        )


def _join_cluster(address: str) -> None:
    """Join the Ray cluster before serving; an address that does not answer ends the start (exit 2)
    instead of a silent single-box manager."""
    try:
        import ray  # noqa: F401
    except ImportError:
        fail("--ray-address needs Ray: pip install 'vllm-manager[cluster]'", code=2)
    from manager.cluster.ray_cluster import RayUnreachable, connect

    try:
        connect(address)
    except RayUnreachable as exc:
        fail(str(exc), code=2)


@models_app.command("list")
def models_list(data_dir: DataDir = None) -> None:
    """List the stored model configs: name, model and offload profile."""
    from manager.services import models

    with open_db(settings_for(data_dir), reading=True) as db:
        typer.echo("name\tmodel\toffload profile")
        for m in models.list_models(db):
            profile = models.profile_of(db, m)
            typer.echo(f"{m.name}\t{m.model}\t{profile.name if profile else '-'}")


@models_app.command("show")
def models_show(name: str, data_dir: DataDir = None) -> None:
    """Show one model config's fields as JSON."""
    from manager.services import models

    with open_db(settings_for(data_dir), reading=True) as db:
        print_json(run(lambda: models.to_public(db, models.get_model(db, name))).model_dump(mode="json"))


@models_app.command("add")
def models_add(
    file: Annotated[Path, typer.Argument(help="YAML or JSON file with the config's fields, name included.")],
    data_dir: DataDir = None,
) -> None:
    """Add a model config from a YAML or JSON file."""
    from pydantic import ValidationError

    from manager.cli_audit import audited
    from manager.schemas.model_config import ModelConfigCreate
    from manager.services import models

    settings = settings_for(data_dir)
    try:
        data = ModelConfigCreate.model_validate(load_structured(file))
    except ValidationError as exc:
        fail(validation_message(exc))
    with open_db(settings) as db:
        audited(
            db,
            "models add",
            "models.create",
            data.name,
            models.create_model,
            db,
            data,
            rules=models.WriteRules.of(settings),
        )
    typer.echo(f"added model config {data.name}")


@models_app.command("rm")
def models_rm(name: str, data_dir: DataDir = None) -> None:
    """Delete a model config (its workers must be stopped)."""
    from manager.cli_audit import audited
    from manager.services import models

    with open_db(settings_for(data_dir), reading=True) as db:
        audited(db, "models rm", "models.delete", name, models.delete_model, db, name)
    typer.echo(f"removed model config {name}")


@profiles_app.command("list")
def profiles_list(data_dir: DataDir = None) -> None:
    """List the stored offload profiles."""
    from manager.services import profiles

    with open_db(settings_for(data_dir), reading=True) as db:
        for p in profiles.list_profiles(db):
            typer.echo(f"{p.name}\tkv_offload_gib={p.kv_offload_gib}\tmoe_offload={p.moe_expert_offload}")


@profiles_app.command("show")
def profiles_show(name: str, data_dir: DataDir = None) -> None:
    """Show one offload profile's fields as JSON."""
    from manager.services import profiles

    with open_db(settings_for(data_dir), reading=True) as db:
        print_json(run(lambda: profiles.to_public(profiles.get_profile(db, name))).model_dump(mode="json"))


@profiles_app.command("add")
def profiles_add(
    file: Annotated[Path, typer.Argument(help="YAML or JSON file with the profile's fields, name included.")],
    data_dir: DataDir = None,
) -> None:
    """Add an offload profile from a YAML or JSON file."""
    from pydantic import ValidationError

    from manager.cli_audit import audited
    from manager.schemas.offload_profile import OffloadProfileCreate
    from manager.services import profiles

    try:
        data = OffloadProfileCreate.model_validate(load_structured(file))
    except ValidationError as exc:
        fail(validation_message(exc))
    with open_db(settings_for(data_dir)) as db:
        audited(db, "profiles add", "profiles.create", data.name, profiles.create_profile, db, data)
    typer.echo(f"added offload profile {data.name}")


@profiles_app.command("rm")
def profiles_rm(name: str, data_dir: DataDir = None) -> None:
    """Delete an offload profile no model config uses."""
    from manager.cli_audit import audited
    from manager.services import profiles

    with open_db(settings_for(data_dir), reading=True) as db:
        audited(db, "profiles rm", "profiles.delete", name, profiles.delete_profile, db, name)
    typer.echo(f"removed offload profile {name}")


@app.command("command")
def command(
    name: str,
    validate: Annotated[bool, typer.Option(help="Check it with vLLM's own parser.")] = True,
    data_dir: DataDir = None,
) -> None:
    """Show the exact argv and environment a model config launches."""
    from manager.launch.command import preview_command
    from manager.launch.validation import validate_engine_argv
    from manager.services import models

    settings = settings_for(data_dir)
    with open_db(settings) as db:
        config = run(models.get_model, db, name)
        cmd = run(preview_command, config, models.profile_of(db, config), settings)
    result = {"argv": cmd.argv, "env": cmd.env, "notes": cmd.notes}
    if validate:
        # vLLM's parser takes seconds to load: the command is shown at once, its verdict when it comes.
        typer.echo(f"{shlex.join(cmd.argv)}\nchecking it with vLLM's own parser...", err=True)
        check = validate_engine_argv(settings.engine_python, cmd.engine_argv, cmd.env, settings.validation_timeout_s)
        result["validation"] = check.__dict__
    print_json(result)
    if validate and result["validation"]["status"] == "rejected":
        raise typer.Exit(1)


@app.command("export")
def export(
    file: Annotated[Path, typer.Argument(help="Where to write the YAML ('-' for stdout).")], data_dir: DataDir = None
) -> None:
    """Export every model config and offload profile as one YAML file."""
    from manager.services import transfer

    with open_db(settings_for(data_dir)) as db:
        text = transfer.export_yaml(db)
    if str(file) == "-":
        sys.stdout.write(text)
    else:
        file.write_text(text)
        typer.echo(f"wrote {file}")


@app.command("import")
def import_(
    file: Annotated[Path, typer.Argument(help="A YAML file from `vllm-manager export`.")],
    overwrite: Annotated[bool, typer.Option(help="Replace stored items with the same names.")] = True,
    data_dir: DataDir = None,
) -> None:
    """Import model configs and offload profiles from an export file."""
    from manager.cli_audit import audited
    from manager.services import transfer
    from manager.services.models import WriteRules

    settings = settings_for(data_dir)
    raw = read_bytes(file)
    with open_db(settings) as db:
        result = audited(
            db,
            "import",
            "import",
            None,
            transfer.import_file,
            db,
            raw,
            overwrite=overwrite,
            rules=WriteRules.of(settings),
        )
    print_json(result)


def _register_key_commands() -> None:
    from manager.cli_keys import keys_app, usage
    from manager.cli_tokens import sessions_app, token_app

    app.add_typer(token_app, name="token")
    app.add_typer(sessions_app, name="sessions")
    app.add_typer(keys_app, name="keys")
    app.command("usage")(usage)


_register_key_commands()


def _register_engine_commands() -> None:
    from manager.cli_engine import demo, engine_app

    app.add_typer(engine_app, name="engine")
    app.command("demo")(demo)


_register_engine_commands()


def _register_apply_commands() -> None:
    from manager.cli_apply import apply, models_edit, models_set

    app.command("apply")(apply)
    models_app.command("set")(models_set)
    models_app.command("edit")(models_edit)


_register_apply_commands()


def _register_download_commands() -> None:
    from manager.cli_pull import downloads, pull

    app.command("pull")(pull)
    app.command("downloads")(downloads)


_register_download_commands()


def _register_audit_command() -> None:
    from manager.cli_audit import audit

    app.command("audit")(audit)


_register_audit_command()
