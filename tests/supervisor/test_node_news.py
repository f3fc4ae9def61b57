"""What a node's return tells the workers: the lost ones on it look for their engine, and those whose
restart the live nodes could not hold (a model spanning nodes) start again, wherever they run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from manager.cluster.nodes import NodeState
from manager.supervisor.node_news import NodeNews
from manager.supervisor.worker_events import NodeBack
from manager.supervisor.worker_state import Life, State


class Events:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def record(self, kind, message, worker_id=None, **data):
        self.kinds.append(kind)
        return {}


@dataclass
class Runner:
    id: int
    node: str
    life: Life
    sent: list[tuple[str, dict]] = field(default_factory=list)

    async def send(self, kind, **kw):
        self.sent.append((kind, kw))


def test_a_node_back_restarts_the_workers_waiting_for_one_and_looks_for_the_lost_ones_engines():
    waiting = Runner(1, "head", Life(State.FAILED, "tp2", desired="running", waits_for_node=True))
    failed = Runner(2, "head", Life(State.FAILED, "big", desired="running", last_error="does not fit"))
    lost = Runner(3, "gpu-b", Life(State.LOST, "small", desired="running"))
    ready = Runner(4, "gpu-b", Life(State.READY, "other", desired="running"))
    runners = [waiting, failed, lost, ready]
    events = Events()
    news = NodeNews(events, lambda: runners, host_of=lambda node: None, can_move=lambda model: True, stop_grace_s=1.0)

    async def scenario() -> None:
        await news.changed("gpu-b", NodeState.ALIVE)
        await asyncio.sleep(0.05)  # the news goes out in the background

    asyncio.run(scenario())
    assert waiting.sent == [("event", {"event": NodeBack()})]  # on the head: it spans nodes, and waited for one
    assert lost.sent == [("node_back", {})]
    assert failed.sent == [] and ready.sent == []
    assert events.kinds == ["node_back"]


def test_a_worker_waiting_for_a_node_still_waits_after_a_manager_restart(tmp_path):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlmodel import MetaData, select

    from manager.db import make_engine, migrate, session
    from manager.schemas.worker import Worker
    from manager.supervisor.runner_deps import life_of

    engine = make_engine(tmp_path / "m.db")
    migrate(engine)
    with session(engine) as db:
        db.add(Worker(model_name="tp2", state="failed", desired="running", waits_for_node=True))
        db.add(Worker(model_name="big", state="failed", desired="running"))
        db.commit()
    with session(engine) as db:
        lives = [life_of(row) for row in db.exec(select(Worker).order_by(Worker.id))]
    assert [life.waits_for_node for life in lives] == [True, False]
    wanted = MetaData()
    Worker.__table__.to_metadata(wanted)
    with engine.connect() as conn:
        diffs = [d for d in compare_metadata(MigrationContext.configure(conn), wanted) if "'worker'" in repr(d)]
    assert diffs == []
