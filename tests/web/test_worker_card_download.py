"""A downloading worker's card and page head: the state line says how far the download is."""

from __future__ import annotations

import re

from manager.hub.fetching import Progress
from manager.metrics import Snapshot, WorkerMetrics
from manager.metrics.gpu import GpuReport
from manager.metrics.host import HostSample
from manager.runtime import worker_info
from manager.supervisor.view import DownloadProgress, WorkerView
from manager.supervisor.worker_state import State
from manager.web.live import worker_signature
from manager.web.render import render

HOST = HostSample(0.0, 2, 8 << 30, 1 << 30, 7 << 30, 0, 0, None, ())


def downloading(progress: Progress | None) -> WorkerView:
    return WorkerView(
        id=4, model="qwen3-30b", served_model_name=None, state=State.DOWNLOADING, detail="downloading Qwen/Qwen3-30B",
        pid=None, port=18004, gpus=[0], uptime_s=None, restart_count=0, next_restart_in_s=None, last_error=None,
        started_at=None, run_dir="/tmp/run", log_file=None,
        download=DownloadProgress.of(progress) if progress is not None else None,
    )  # fmt: skip


def snapshot(view: WorkerView) -> Snapshot:
    info = worker_info(view)
    worker = WorkerMetrics(
        id=info.id, model=info.model, state=info.state, port=info.port, restarts=0, uptime_s=None, process=None,
        gpu_memory_bytes=None, engine=None, pools=None, download=info.download,
        download_percent=info.download_percent,
    )  # fmt: skip
    return Snapshot(1, 0.0, GpuReport.unavailable("test"), HOST, (worker,))


def state_text(html: str) -> str:
    found = re.search(r'data-testid="state">([^<]*)<', html)
    assert found is not None
    return found.group(1)


def test_the_card_and_the_head_of_a_downloading_worker_say_how_far_its_download_is():
    snap = snapshot(downloading(Progress("Qwen/Qwen3-30B", 34, 100, rate_bps=0.55)))  # 120 s left
    card = render("fragments/worker_cards.html", snap=snap, model_names=["qwen3-30b"])
    assert state_text(card) == "downloading 34 %, about 2 min left"
    assert 'class="card worker-card state-downloading"' in card
    head = render("fragments/worker_head.html", w=snap.workers[0], snap=snap)
    assert state_text(head) == "downloading 34 %, about 2 min left"
    # Its Stop button works (the wait for the download ends); Start and Delete wait for that.
    assert re.search(r"/stop\"[^>]*>Stop</button>", card)
    assert re.search(r"/start\"[^>]*disabled[^>]*>Start</button>", card)


def test_before_its_progress_is_known_the_state_line_just_says_downloading():
    snap = snapshot(downloading(None))
    assert state_text(render("fragments/worker_cards.html", snap=snap, model_names=[])) == "downloading"


def test_the_cards_are_redrawn_at_each_percent_not_at_each_second_left():
    first = worker_signature(snapshot(downloading(Progress("Qwen/Qwen3-30B", 34, 100, rate_bps=1.0))))
    later = worker_signature(snapshot(downloading(Progress("Qwen/Qwen3-30B", 34, 100, rate_bps=2.0))))
    further = worker_signature(snapshot(downloading(Progress("Qwen/Qwen3-30B", 35, 100, rate_bps=2.0))))
    assert first == later and later != further
