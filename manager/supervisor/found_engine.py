"""What an engine the manager finds running (after its own restart, or started by hand) hides and asks
for: the secrets its events and log lines hide, and the API key its /v1 endpoints ask for."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from manager.db import session
from manager.errors import Invalid, NotFound
from manager.launch.engine_key import engine_key, key_values
from manager.launch.secrets import Redactor
from manager.services import models


def found_engine_secrets(store: Engine, model_name: str, cmdline: list[str]) -> tuple[Redactor, str | None]:
    """Its config's secrets and its own argv's; and the API key its own argv gives (an engine started
    by hand), else its config's (the manager gives it through the engine's environment)."""
    with session(store) as db:
        try:
            config = models.get_model(db, model_name)
        except NotFound:
            config = None
    secrets = Redactor.of_config(config, cmdline) if config is not None else Redactor(cmdline)
    given = key_values(cmdline)
    if given is not None:
        return secrets, next((key for key in given if key), None)
    if config is None:
        return secrets, None
    try:
        return secrets, engine_key(config.extra_args, config.env)
    except Invalid:
        return secrets, None
