"""The OpenAPI schema is the truth: schemathesis drives every operation of the real app with all of its
checks (status codes, error shapes, media types, constraints, methods, authentication), without a token
and with one, and finds nothing the schema does not say: against an empty store, and the calls on a
worker against one whose worker is starting and never ready."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import schemathesis
from fastapi import FastAPI
from schemathesis.engine import Status, events, from_schema
from schemathesis.python import asgi

from manager.app import create_app
from manager.settings import Settings
from tests.support.engine import stop_leftover_engines
from tests.support.hub_server import TestHub

TOKEN = "vmt_contract-test-token-" + "t" * 20
EXAMPLES = 8  # per operation and phase, from a fixed seed: the whole file runs in about 2 minutes on 2 cores

# Rejections of schema-valid requests that no JSON schema can state, allowed where they happen as
# schemathesis' own guide says to allow them (everything else a request can get wrong is in the schema):
CANNOT_STATE = {
    "POST /api/models": "tensor_parallel_size against the number of gpu_ids, and times the pipeline and data "
    "parallel sizes in extra_args; extra_args and env together at most 256 KiB; an alias that is the served model "
    "name; '~user' for a user this machine lacks; a model or served_model_name starting with '-'",
    "PUT /api/models/{name}": "the same rules as POST /api/models",
    "POST /api/import": "the same rules for each config in the file; a config naming a profile nowhere stored",
    "POST /api/loras": "the folder must hold a LoRA adapter (adapter_config.json and weights)",
    "POST /api/plan": "the model folder must exist and hf_config be a model's config.json",
    "GET /api/metrics/history": "a window longer than 0 and no longer than the history kept",
    "POST /api/keys": "each model a key names must be a stored model config; expires_at a time to come",
    "PATCH /api/keys/{name}": "expires_at a time to come",
    "GET /api/usage": "since before until, and a span no longer than the bucket size allows",
    "GET /api/audit": "since before until",
    "POST /api/workers": "a node only where the manager runs with a Ray cluster",
    "POST /api/downloads": "huggingface_hub's rules for a repo id: no '--' or '..', not ending in '-' or '.'",
}
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]  # schemathesis' default, for a valid request

# Endless: they answer until the client goes away.
STREAMS = r"/stream$"
# These start an engine for a stored model config: they run against a manager whose store stays empty,
# where each answers without starting anything.
ENGINE_STARTS = r"^/api/workers$|^/v1/|^/(de)?tokenize$"


def _config(token: str | None, left_out: list[dict[str, str]]) -> schemathesis.Config:
    return schemathesis.Config.from_dict(
        {
            "seed": 20260101,
            "headers": {"Authorization": f"Bearer {token}"} if token else {},
            "generation": {"max-examples": EXAMPLES, "deterministic": True, "database": "none"},
            "checks": {"enabled": True},
            "operations": [
                *({**selection, "enabled": False} for selection in left_out),
                *(
                    {
                        "include-name": name,
                        "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTED, "422"]}},
                    }
                    for name in CANNOT_STATE
                ),
            ],
        }
    )


def _started(settings: Settings) -> FastAPI:
    """A running app (schemathesis keeps it running for every call), its first metrics sample taken."""
    app = create_app(settings)
    with asgi.get_client(cast(Any, app)) as client:  # schemathesis types ASGI apps narrowly
        deadline = time.monotonic() + 30
        while client.get("/api/metrics").status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
    return app


def _settings(tmp: Path, token: str | None, engine_python: str | None = None) -> Settings:
    engine_python = engine_python or str(tmp / "no-engine-here")
    return Settings(data_dir=tmp / "data", engine_python=engine_python, api_token=token, stop_workers_on_exit=True)


def _failures(app: FastAPI, token: str | None, left_out: list[dict[str, str]]) -> list[str]:
    """What ``st run --checks all`` reports against the app: every failure, once."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}  # the schema is a read like any other
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=_config(token, left_out), headers=headers)
    found: dict[str, None] = {}
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for checks in event.recorder.checks.values():
                for check in checks:
                    if check.status == Status.FAILURE and check.failure_info is not None:
                        failure = check.failure_info.failure
                        found[
                            f"{failure.code} {failure.operation}: {failure.title}: {failure.message}"
                            f"\n  {check.failure_info.code_sample}"
                        ] = None
        elif isinstance(event, events.NonFatalError):
            found[f"error in {event.label}: {event.info.format()}"] = None
        elif isinstance(event, events.FatalError):
            found[f"schemathesis stopped: {event.exception!r}"] = None
    return list(found)


@pytest.fixture(params=[None, TOKEN], ids=["without-token", "with-token"])
def token(request) -> str | None:
    return request.param


@pytest.fixture
def quiet_machine(tmp_path) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch, TestHub() as hub:
        # The vLLM servers other people run on this machine are not this test's to stop or adopt.
        patch.setattr("manager.host.process.find_engines", lambda exclude: [])
        # A hub that holds no model: plans and downloads of a hub id get its answers (no such repo).
        patch.setenv("HF_ENDPOINT", hub.url)
        patch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        try:
            yield
        finally:
            asgi.shutdown_lifespans()


def test_every_call_does_what_the_schema_says(tmp_path, token, quiet_machine):
    app = _started(_settings(tmp_path, token))
    failures = _failures(app, token, [{"include-path-regex": STREAMS}, {"include-path-regex": ENGINE_STARTS}])
    assert not failures, "\n\n".join(failures)


def test_the_calls_that_start_engines_do_what_the_schema_says(tmp_path, token, quiet_machine):
    app = _started(_settings(tmp_path, token))  # its store stays empty: no model config for them to start
    failures = _failures(app, token, [{"exclude-path-regex": ENGINE_STARTS}])
    assert not failures, "\n\n".join(failures)


# The calls on a worker, against a manager with one model config whose engine runs and never answers,
# and a worker of it that is starting (not ready) when they begin.
WORKER_CALLS = r"^/api/workers"


def _never_ready(tmp: Path) -> str:
    """An "engine interpreter" that runs whatever it is asked to and never answers: its worker stays starting."""
    script = tmp / "engine-that-never-answers"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    script.chmod(0o755)
    return str(script)


def test_the_calls_on_a_worker_that_is_not_ready_do_what_the_schema_says(tmp_path, token, quiet_machine):
    settings = _settings(tmp_path, token, engine_python=_never_ready(tmp_path))
    app = _started(settings)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=_config(token, []), headers=headers)
    try:
        start = schema["/api/workers"]["POST"]
        folder = tmp_path / "never-ready"  # a local model folder: a hub id would be downloaded first
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        config = {"name": "never-ready", "model": str(folder), "start_timeout_s": 600}
        with asgi.get_client(cast(Any, app)) as client:
            assert client.post("/api/models", json=config, headers=headers).status_code == 201
        for expected in (201, 200):  # a second start answers with the worker already starting
            case = start.Case(body={"model": "never-ready"}, headers=headers)
            started = case.call()
            assert started.status_code == expected and started.json()["state"] == "starting", started.text
            case.validate_response(started)
        failures = _failures(app, token, [{"include-path-regex": STREAMS}, {"exclude-path-regex": WORKER_CALLS}])
    finally:
        stop_leftover_engines(settings.data_dir)
    assert not failures, "\n\n".join(failures)
