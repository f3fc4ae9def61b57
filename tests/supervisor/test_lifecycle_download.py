"""The download phase of a worker's start, in the state machine alone: a hub model missing from the
engine's cache is downloaded first (its own state, its own timeout), and only then is the engine launched.

As in test_lifecycle.py, each test feeds ``lifecycle.step`` what the runner would: here a Launch is
answered with NeedsDownload, and the Fetch effect with Fetched.
"""

from __future__ import annotations

from manager.errors import Invalid
from manager.supervisor.policy import Policy, tick_interval
from manager.supervisor.worker_effects import Effect, Fetch, Launch
from manager.supervisor.worker_events import (
    DeleteRequested,
    Exited,
    Fetched,
    FoundGone,
    GroupStopped,
    Killed,
    LaunchRefused,
    NeedsDownload,
    NodeLost,
    RestartRequested,
    SleepRequested,
    StartRequested,
    StopRequested,
    SwitchRequested,
    Tick,
    WakeRequested,
)
from manager.supervisor.worker_state import SERVING, Life, State
from tests.supervisor.test_lifecycle import kinds, launched, probed, records, running, step, stopped


def needs_download(effect: Effect, repo: str = "org/a", now: float = 0.0) -> NeedsDownload:
    """What the runner answers a Launch whose model is not complete in the engine's cache."""
    assert isinstance(effect, Launch)
    return NeedsDownload(effect, repo, now)


def downloading(model: str = "a", now: float = 0.0) -> tuple[Life, Fetch]:
    """A worker whose start is waiting for its model's download."""
    life, effects = step(stopped(model), StartRequested())
    life, effects = step(life, needs_download(effects[0], f"org/{model}", now))
    fetch = effects[-1]
    assert life.state == State.DOWNLOADING and isinstance(fetch, Fetch)
    return life, fetch


def test_a_start_whose_model_must_be_downloaded_downloads_first_and_holds_its_config():
    life, effects = step(stopped(), StartRequested())
    life, effects = step(life, needs_download(effects[0], now=5.0))
    assert life.state == State.DOWNLOADING and life.active and life.state not in SERVING
    assert life.engine is None and life.desired == "running" and life.model == "a"
    assert life.download == "org/a" and life.detail == "downloading org/a"
    assert effects[-1] == Fetch("org/a", 5.0)
    assert records(effects) == [("download", "start: downloading org/a from the Hugging Face Hub before a starts")]
    # Nothing to watch meanwhile: the wait for the download answers by itself.
    assert tick_interval(life, 6.0, Policy()) is None


def test_a_second_start_while_downloading_starts_nothing():
    life, _ = downloading()
    assert step(life, StartRequested()) == (life, [])
    assert step(life, SwitchRequested("a", alive=False)) == (life, [])


def test_a_complete_download_launches_the_engine_whose_start_timeout_begins_only_then():
    life, fetch = downloading(now=0.0)
    life, effects = step(life, Fetched(True, "", fetch.since, 600.0))
    assert records(effects) == [("download", "downloaded org/a in 600 s")]
    assert effects[-1] == Launch("a", "start", False, downloaded=True)
    assert life.state == State.DOWNLOADING  # the config stays held until the engine is launched
    life, effects = step(life, launched(effects[-1], pid=7, now=601.0, timeout=60.0))
    assert life.state == State.STARTING and life.download is None and life.after_download is None
    assert life.deadline == 661.0  # the start timeout counts from the launch, not from the start request
    life, _ = step(life, probed(602.0))
    assert life.state == State.READY


def test_a_download_that_fails_fails_the_worker_with_the_reason():
    life, fetch = downloading(now=0.0)
    reason = "the download took longer than download_timeout_s (30 s)"
    life, effects = step(life, Fetched(False, reason, fetch.since, 30.5))
    assert life.state == State.FAILED and life.last_error == reason and life.download is None
    assert records(effects) == [
        ("download", "gave up on the download of org/a after 30 s"),
        ("failed", reason),
    ]
    assert "Launch" not in kinds(effects)
    # A new start tries again (and rejoins the download, if it goes on).
    life, effects = step(life, StartRequested())
    assert effects == [Launch("a", "start", False)]


def test_stop_while_downloading_cancels_the_wait_and_the_download_goes_on():
    life, fetch = downloading()
    life, effects = step(life, StopRequested("stop requested", alive=False))
    assert life.state == State.STOPPED and life.desired == "stopped" and not life.active
    assert life.download is None and life.after_download is None
    assert kinds(effects) == ["StopFetching", "Record"]
    assert records(effects) == [("stopped", "stop requested; the download of org/a goes on")]
    # The end of the wait it gave up on changes nothing.
    assert step(life, Fetched(True, "", fetch.since, 9.0)) == (life, [])


def test_delete_while_downloading_cancels_the_wait_and_forgets():
    life, _ = downloading()
    life, effects = step(life, DeleteRequested(alive=False))
    assert life.state == State.STOPPED and kinds(effects) == ["StopFetching", "Record", "Forget", "Record"]


def test_restart_while_downloading_waits_again_for_the_same_download():
    life, first = downloading(now=0.0)
    life, effects = step(life, RestartRequested(alive=False))
    assert kinds(effects) == ["StopFetching", "Record", "Launch"]
    life, effects = step(life, needs_download(effects[-1], now=3.0))
    assert life.state == State.DOWNLOADING and effects[-1] == Fetch("org/a", 3.0)
    # Only the new wait's end counts: the old one's answer is stale.
    assert step(life, Fetched(False, "cancelled", first.since, 4.0)) == (life, [])
    life, effects = step(life, Fetched(True, "", 3.0, 5.0))
    assert effects[-1] == Launch("a", "restart", False, downloaded=True)


def test_switch_while_downloading_cancels_the_wait_and_starts_the_other_config():
    life, _ = downloading("a")
    life, effects = step(life, SwitchRequested("b", alive=False))
    assert kinds(effects) == ["StopFetching", "Record", "Record", "Launch"]
    assert effects[-1] == Launch("b", "switch from a", False)
    life, _ = step(life, launched(effects[-1], pid=3))
    assert life.state == State.STARTING and life.model == "b"


def test_a_switch_to_a_config_that_downloads_holds_that_config_and_rolls_back_when_it_fails():
    life = running("a", pid=1)
    life, effects = step(life, SwitchRequested("b", alive=True))
    life, _ = step(life, GroupStopped(True, 1.0, (), ()))
    life, effects = step(life, needs_download(effects[-1], "org/b", now=2.0))
    assert life.state == State.DOWNLOADING and life.model == "b" and life.switch_from == "a"
    life, effects = step(life, Fetched(False, "401: org/b is gated", 2.0, 8.0))
    assert effects[-1] == Launch("a", "roll back after failed switch to b", False)
    life, _ = step(life, launched(effects[-1], pid=4))
    assert life.state == State.STARTING and life.model == "a"
    assert life.last_error == "switch to b failed: 401: org/b is gated; rolled back to a"


def test_a_start_refused_after_its_download_fails_the_worker_instead_of_leaving_it_downloading():
    life, fetch = downloading()
    life, effects = step(life, Fetched(True, "", fetch.since, 10.0))
    life, effects = step(life, LaunchRefused(Invalid("a needs 70 GiB of GPU memory, 20 GiB free")))
    assert life.state == State.FAILED and life.download is None
    assert life.last_error == "start refused: a needs 70 GiB of GPU memory, 20 GiB free"
    assert "Reject" not in kinds(effects)  # the start request was answered long ago


def test_a_worker_downloading_when_the_manager_stopped_starts_again_and_rejoins_the_download():
    stored = Life(state=State.DOWNLOADING, model="a", port=18000, desired="running")
    life, effects = step(stored, FoundGone())
    assert effects == [Launch("a", "its download was under way at a manager restart", False)]
    assert life.active  # still holds its config while the start is prepared
    life, effects = step(life, needs_download(effects[0], now=1.0))
    assert life.state == State.DOWNLOADING and effects[-1] == Fetch("org/a", 1.0)
    # Complete meanwhile: the launch goes ahead at once.
    again, effects = step(stored, FoundGone())
    again, _ = step(again, launched(effects[0], pid=9))
    assert again.state == State.STARTING


def test_a_downloading_worker_cannot_sleep_or_wake_and_ignores_engine_events():
    life, _ = downloading()
    for event in (SleepRequested(1), WakeRequested()):
        same, effects = step(life, event)
        assert same == life and kinds(effects) == ["Reject"]
    for event in (
        probed(1.0),
        Exited("exited", None, 1.0),
        Killed("hung", 1.0),
        Tick(1.0),
        NodeLost("box2", can_move=True),
    ):
        assert step(life, event) == (life, [])
