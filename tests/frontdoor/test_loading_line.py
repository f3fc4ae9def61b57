"""What a streamed request waiting for its model is told it waits for: real numbers only."""

from __future__ import annotations

from manager.frontdoor.loading import line
from manager.frontdoor.slots import Loading
from manager.hub.fetching import Progress
from manager.supervisor.view import DownloadProgress, WorkerView
from manager.supervisor.worker_state import State


def view(state: State, download: Progress | None = None) -> WorkerView:
    return WorkerView(
        id=1, model="qwen", node=None, served_model_name="qwen", state=state, detail=None, pid=None, port=18001,
        gpus=[0], uptime_s=None, restart_count=0, next_restart_in_s=None, last_error=None, started_at=None,
        run_dir="/tmp/run", log_file=None, download=DownloadProgress.of(download) if download else None,
    )  # fmt: skip


def test_a_download_says_its_bytes_done():
    progress = Progress("org/qwen", 42, 100)
    assert line("qwen", view(State.DOWNLOADING, progress), None, {}, 0.0) == "downloading qwen 42 %"
    assert line("qwen", view(State.DOWNLOADING), None, {}, 0.0) == "downloading qwen"


def test_a_start_is_measured_against_the_last_one_and_never_says_done():
    started = Loading("cold", 1, since=100.0)
    assert line("qwen", view(State.STARTING), started, {"cold": 40.0}, 110.0) == "loading qwen 25 %"
    assert line("qwen", view(State.STARTING), started, {"cold": 40.0}, 200.0) == "loading qwen 99 %"
    # A wake is measured against the last wake, not the last start.
    woken = Loading("wake", 1, since=100.0)
    assert line("qwen", view(State.WAKING), woken, {"cold": 40.0, "wake": 4.0}, 102.0) == "waking qwen 50 %"


def test_without_an_earlier_start_only_the_seconds_are_said():
    started = Loading("cold", 1, since=100.0)
    assert line("qwen", view(State.STARTING), started, {}, 112.4) == "starting qwen, 12 s"
    assert line("qwen", view(State.WAKING), Loading("wake", 1, 100.0), {"cold": 9.0}, 103.0) == "waking qwen, 3 s"


def test_a_start_someone_else_made_or_a_turn_in_line_has_no_number():
    assert line("qwen", view(State.STARTING), None, {"cold": 40.0}, 0.0) == "starting qwen"
    assert line("qwen", view(State.READY), None, {}, 0.0) == "waiting for a turn at qwen"
    assert line("qwen", None, None, {}, 0.0) == "waiting for qwen"
