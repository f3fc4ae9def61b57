"""The usage recorder: counts in memory, written per minute, key and model; nothing lost when a write fails."""

from __future__ import annotations

import asyncio

from sqlalchemy import text

from manager.db import make_engine, migrate, session
from manager.frontdoor.metering import Tokens
from manager.frontdoor.usage import UsageRecorder
from manager.schemas.inference_key import InferenceKeyCreate
from manager.schemas.usage import NO_KEY, UsageMinute
from manager.services import inference_keys, usage


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def store(tmp_path):
    engine = make_engine(tmp_path / "manager.db")
    migrate(engine)
    return engine


def rows(engine) -> list[tuple]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text(
                    "SELECT minute, key_id, model, requests, errors, prompt_tokens, completion_tokens "
                    "FROM usage_minute ORDER BY minute, key_id, model"
                )
            )
        ]


def test_counts_go_to_their_minute_key_and_model_and_add_up_across_writes(tmp_path):
    engine = store(tmp_path)
    clock = Clock(1_800_000_030.0)  # 30 s into a minute

    async def scenario() -> None:
        recorder = UsageRecorder(engine, clock=clock)
        recorder.count(7, "a", Tokens(2, 3), error=False)
        recorder.count(7, "a", None, error=True)
        recorder.count(NO_KEY, "a", Tokens(1, 1), error=False)
        await recorder.flush()
        recorder.count(7, "a", Tokens(10, 20), error=False)  # the same minute, written later
        clock.now += 60
        recorder.count(7, "b", Tokens(5, 0), error=False)
        await recorder.flush()

    asyncio.run(scenario())
    minute = 1_800_000_000
    assert rows(engine) == [
        (minute, NO_KEY, "a", 1, 0, 1, 1),
        (minute, 7, "a", 3, 1, 12, 23),
        (minute + 60, 7, "b", 1, 0, 5, 0),
    ]


def test_a_write_that_fails_keeps_the_counts_for_the_next(tmp_path):
    engine = store(tmp_path)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE usage_minute"))

    async def scenario() -> None:
        recorder = UsageRecorder(engine, clock=Clock(600.0))
        recorder.count(NO_KEY, "a", Tokens(1, 2), error=False)
        await recorder.flush()  # no table: refused, kept
        UsageMinute.__table__.create(engine)
        recorder.count(NO_KEY, "a", Tokens(1, 2), error=False)
        await recorder.flush()

    asyncio.run(scenario())
    assert rows(engine) == [(600, NO_KEY, "a", 2, 0, 2, 4)]


def test_stopping_writes_what_is_left_and_the_keys_last_use(tmp_path):
    engine = store(tmp_path)
    with session(engine) as db:
        made = inference_keys.create_key(db, InferenceKeyCreate(name="app"))
        key = inference_keys.list_keys(db)[0]
    assert key.prefix == made.prefix and key.id is not None and key.last_used_at is None

    async def scenario() -> None:
        recorder = UsageRecorder(engine, flush_s=3600)
        recorder.start()
        recorder.key_used(key.id)
        recorder.count(key.id, "a", Tokens(4, 4), error=False)
        await recorder.stop()

    asyncio.run(scenario())
    with session(engine) as db:
        report = usage.report(db, per="minute")
        stored = inference_keys.list_keys(db)[0]
    assert [(t.key, t.model, t.requests, t.prompt_tokens) for t in report.totals] == [("app", "a", 1, 4)]
    assert stored.last_used_at is not None
