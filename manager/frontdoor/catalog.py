"""What /v1 reads of the store on every request: the names that route to each model config, who may
call (inference keys, admin token digests), and each config's max_concurrent and loading_progress. Each is read again only
once something was committed to the store (by this process, another one or the CLI), not per request.
"""

from __future__ import annotations

from sqlalchemy.engine import Engine
from sqlmodel import select

from manager.db import CommitWatch, ReadAfterCommits, session
from manager.frontdoor import names
from manager.frontdoor.access import ANYONE, Caller, Credentials, caller_for, read_credentials
from manager.frontdoor.errors import ModelNotFound
from manager.schemas.lora_adapter import LoraAdapter
from manager.schemas.model_config import ModelConfig
from manager.settings import Settings


class Catalog:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commits = CommitWatch(engine)
        self._names = ReadAfterCommits(self._commits, self._read_names)
        self._credentials = ReadAfterCommits(self._commits, self._read_credentials)
        self._max_concurrent = ReadAfterCommits(self._commits, self._read_max_concurrent)
        self._loading_progress = ReadAfterCommits(self._commits, self._read_loading_progress)

    def close(self) -> None:
        self._commits.close()

    def name_table(self, caller: Caller = ANYONE) -> names.NameTable:
        """The names ``caller`` may use: every name, or those of the model configs its key names."""
        table = self._names.get()
        return table if caller.models is None else table.only(caller.models)

    def caller(self, bearer: str | None, settings: Settings) -> Caller:
        """Who a /v1 request with this bearer token comes from (NoCredentials: a 401 saying what to send)."""
        return caller_for(self._credentials.get(), bearer, settings)

    def resolve(self, requested: str, caller: Caller = ANYONE) -> names.Target:
        try:
            return self.name_table(caller).resolve(requested)
        except names.UnknownModel as exc:
            raise ModelNotFound(str(exc), param="model") from None

    def max_concurrent(self, config: str) -> int | None:
        """The most requests ``config`` may have in flight (its max_concurrent); None: no limit."""
        return self._max_concurrent.get().get(config)

    def _read_max_concurrent(self) -> dict[str, int]:
        with session(self.engine) as db:
            rows = db.exec(select(ModelConfig.name, ModelConfig.max_concurrent))
            return {name: limit for name, limit in rows if limit is not None}

    def loading_progress(self, config: str) -> bool:
        """Whether ``config``'s streamed requests get loading progress while they wait for it."""
        return config in self._loading_progress.get()

    def _read_loading_progress(self) -> frozenset[str]:
        with session(self.engine) as db:
            return frozenset(db.exec(select(ModelConfig.name).where(ModelConfig.loading_progress == True)))  # noqa: E712

    def _read_credentials(self) -> Credentials:
        with session(self.engine) as db:
            return read_credentials(db)

    def _read_names(self) -> names.NameTable:
        with session(self.engine) as db:
            configs = [
                names.ConfigNames(c.name, c.served_model_name, tuple(c.aliases), int(c.created_at.timestamp()))
                for c in db.exec(select(ModelConfig))
            ]
            adapters = [
                names.AdapterNames(a.name, a.base_config, int(a.created_at.timestamp()))
                for a in db.exec(select(LoraAdapter))
            ]
        return names.NameTable(configs, adapters)
