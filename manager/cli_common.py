"""What every `vllm-manager` command that works on the store shares: the data dir option, opening the
store, and turning a user error into a message and an exit code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

if TYPE_CHECKING:
    from manager.settings import Settings

DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Data folder (default ~/.local/share/vllm-manager).")]


def settings_for(data_dir: Path | None = None, **overrides) -> Settings:
    from manager.settings import Settings

    if data_dir is not None:
        overrides["data_dir"] = data_dir
    return Settings(**overrides)


def open_db(settings: Settings, *, reading: bool = False):
    """The store, or exit 2 with what is wrong with the data dir or the database in it. ``reading``:
    the command only reads or removes, so a data dir without a store is a mistaken folder, said so
    (and not made)."""
    from manager.db import make_engine, migrate, session
    from manager.errors import ManagerError
    from manager.settings import DataDirUnusable

    if reading and not settings.db_path.exists():
        fail(
            f"no manager data in {settings.data_dir} (it holds no manager.db): pass --data-dir, or set "
            "VLLM_MANAGER_DATA_DIR, to the folder `vllm-manager serve` uses",
            code=2,
        )
    try:
        settings.ensure_dirs()
        engine = make_engine(settings.db_path)
        migrate(engine)
    except DataDirUnusable as exc:
        fail(str(exc), code=2)
    except ManagerError as exc:  # a database that cannot be written, a full disk
        fail(exc.message, code=2)
    except OSError as exc:
        fail(f"the database {settings.db_path} cannot be opened ({exc.strerror or exc}): check its permissions", 2)
    return session(engine)


def fail(message: str, code: int = 1) -> NoReturn:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def print_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def run(fn, *args, **kwargs):
    """Call a library function and turn a user error into a message and exit code 1."""
    from manager.errors import ManagerError

    try:
        return fn(*args, **kwargs)
    except ManagerError as exc:
        fail(exc.message)


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")


def load_structured(path: Path) -> dict:
    import yaml

    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        fail(f"cannot read {path}: {exc}")


def validation_message(exc) -> str:
    first = exc.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc']) or 'input'}: {first['msg']}"
