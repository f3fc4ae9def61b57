"""What a user of the CPU demo does, checked against the running container (docker/ci/images.sh).

  first    the dashboard answers; a model config is stored through the API (the tiny model the
           container made at start, --load-format dummy) and started; /v1/chat/completions answers
           through the manager's front door with the official openai client
  restart  after `docker compose restart`: the config is still stored and its worker is back (the
           config autostarts), and /v1/chat/completions answers again

Usage: python cpu_demo_check.py first|restart URL TOKEN_FILE
Run with a Python that has httpx and openai (the test venv).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

NAME = "ci-tiny"
CONFIG = {
    "name": NAME,
    # Made by the image's start script (manager/tiny_model.py) in the data volume.
    "model": "/data/models/tiny-llama",
    "served_model_name": NAME,
    # On vLLM's CPU backend a share of host RAM: kept small on a shared machine.
    "gpu_memory_utilization": 0.1,
    "max_model_len": 1024,
    "extra_args": ["--load-format", "dummy"],
    # What brings the worker back after a restart of the container.
    "autostart": True,
}
READY_TIMEOUT_S = 600


def fail(message: str) -> None:
    print(f"cpu-demo: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def wait_ready(api: httpx.Client, name: str) -> dict:
    """The config's ready worker; after a restart the list may also hold its earlier, stopped one."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    shown: set[tuple] = set()
    workers: list[dict] = []
    while time.monotonic() < deadline:
        workers = [w for w in api.get("/api/workers").raise_for_status().json() if w["model"] == name]
        ready = [w for w in workers if w["state"] == "ready"]
        if ready:
            return ready[0]
        if workers and all(w["state"] == "failed" for w in workers):
            fail(f"worker of {name} failed: {workers[-1]['last_error']}")
        for w in workers:
            if (w["id"], w["state"], w["detail"]) not in shown:
                shown.add((w["id"], w["state"], w["detail"]))
                print(f"cpu-demo: worker {w['id']} of {name}: {w['state']} {w['detail'] or ''}")
        time.sleep(3)
    fail(f"no worker of {name} ready after {READY_TIMEOUT_S}s: {workers}")
    raise AssertionError  # fail() exits


def chat(url: str, token: str) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key=token, timeout=300)
    reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    tokens = reply.usage.completion_tokens if reply.usage else 0
    if reply.choices[0].finish_reason not in ("stop", "length") or not tokens:
        fail(f"/v1/chat/completions answered without tokens: {reply}")
    print(
        f"cpu-demo: /v1/chat/completions answered {tokens} tokens from {reply.model}: {reply.choices[0].message.content!r}"
    )


def first(api: httpx.Client, url: str, token: str) -> None:
    anonymous = httpx.get(f"{url}/", headers={"Accept": "text/html"}, follow_redirects=False, timeout=30)
    if anonymous.status_code not in (302, 303, 307) or "/login" not in anonymous.headers.get("location", ""):
        fail(
            f"the dashboard asked for by a browser without the token answered {anonymous.status_code}, expected a redirect to /login"
        )
    page = api.get("/")
    if page.status_code != 200 or "tiny-llama-demo" not in page.text:
        fail(f"dashboard answered {page.status_code} without the demo's model config")
    print("cpu-demo: dashboard answers and lists tiny-llama-demo")

    stored = api.post("/api/models", json=CONFIG)
    if stored.status_code != 201:
        fail(f"POST /api/models answered {stored.status_code}: {stored.text}")
    started = api.post("/api/workers", json={"model": NAME})
    if started.status_code not in (200, 201):
        fail(f"POST /api/workers answered {started.status_code}: {started.text}")
    worker = wait_ready(api, NAME)
    print(f"cpu-demo: worker {worker['id']} of {NAME} ready on port {worker['port']}")
    chat(url, token)


def after_restart(api: httpx.Client, url: str, token: str) -> None:
    names = {m["name"] for m in api.get("/api/models").raise_for_status().json()}
    if not {"tiny-llama-demo", NAME} <= names:
        fail(f"model configs lost by the restart: stored now {sorted(names)}")
    print(f"cpu-demo: model configs kept: {sorted(names)}")
    worker = wait_ready(api, NAME)
    print(f"cpu-demo: worker {worker['id']} of {NAME} is back, ready on port {worker['port']}")
    chat(url, token)


def main() -> None:
    step, url, token_file = sys.argv[1:4]
    token = Path(token_file).read_text().strip()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as api:
        {"first": first, "restart": after_restart}[step](api, url, token)


if __name__ == "__main__":
    main()
