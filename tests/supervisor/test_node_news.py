"""What a node's return tells the workers: the lost ones on it look for their engine, and those whose
restart the live nodes could not hold (a model spanning nodes) start again, wherever they run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from manager.cluster.nodes import NodeState
from manager.supervisor.node_news import NodeNews
from manager.supervisor.worker_events import NodeBack, NodeLost, SpanNodeLost
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


def news_of(events, runners, spanning=()):
    return NodeNews(
        events,
        lambda: runners,
        host_of=lambda node: None,
        can_move=lambda model: True,
        spans_nodes=lambda model: model in spanning,
        stop_grace_s=1.0,
    )


def test_a_node_back_is_told_to_every_worker_and_the_lost_ones_look_for_their_engines():
    waiting = Runner(1, "head", Life(State.FAILED, "tp2", desired="running", waits_for_node=True))
    failed = Runner(2, "head", Life(State.FAILED, "big", desired="running", last_error="does not fit"))
    lost = Runner(3, "gpu-b", Life(State.LOST, "small", desired="running"))
    ready = Runner(4, "gpu-b", Life(State.READY, "other", desired="running"))
    runners = [waiting, failed, lost, ready]
    events = Events()
    news = news_of(events, runners)

    async def scenario() -> None:
        await news.changed("gpu-b", NodeState.ALIVE)
        await asyncio.sleep(0.05)  # the news goes out in the background

    asyncio.run(scenario())
    # Every worker hears of the node back, and its own state machine decides (tests/supervisor/
    # test_lifecycle.py): a restart refused while the news was on its way is waiting by then.
    back = ("event", {"event": NodeBack()})
    assert waiting.sent == [back] and failed.sent == [back] and ready.sent == [back]
    assert lost.sent == [("node_back", {}), back]  # on the node: it looks for its engine there
    assert events.kinds == ["node_back"]


def test_a_lost_node_is_told_to_the_workers_of_models_spanning_nodes_wherever_their_engine_runs():
    on_lost = Runner(1, "gpu-b", Life(State.READY, "small", desired="running"))
    spanning_start = Runner(2, "head", Life(State.STARTING, "tp2", desired="running"))
    spanning_ready = Runner(3, "head", Life(State.READY, "tp2-other", desired="running"))
    local_start = Runner(4, "head", Life(State.STARTING, "one-gpu", desired="running"))
    runners = [on_lost, spanning_start, spanning_ready, local_start]
    news = news_of(Events(), runners, spanning=("tp2", "tp2-other"))

    async def scenario() -> None:
        await news.changed("gpu-b", NodeState.LOST)
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert on_lost.sent == [("event", {"event": NodeLost("gpu-b", can_move=True)})]
    # Every worker of a model spanning nodes is told, whatever its state (a launch being carried out
    # is a start by the time it reads the news); only a start under way is ended (test_lifecycle.py).
    told = [("event", {"event": SpanNodeLost("gpu-b")})]
    assert spanning_start.sent == told and spanning_ready.sent == told
    assert local_start.sent == []


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
