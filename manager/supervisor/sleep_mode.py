"""vLLM's sleep mode on one engine: its dev endpoints (``VLLM_SERVER_DEV_MODE=1``, ``--enable-sleep-mode``).

``POST /sleep?level=N`` releases the engine's GPU memory (level 1 moves the weights to host RAM,
level 2 drops them), ``POST /wake_up`` takes it back, ``GET /is_sleeping`` says which it is. A
level-2 sleeper has no weights left: waking it reallocates them (``/wake_up?tags=weights``), loads
them again from the model's files (``/collective_rpc`` ``reload_weights``), then reallocates the rest.
Each call answers (done, seconds, what went wrong); the runner turns that into a lifecycle event.
"""

from __future__ import annotations

import time

import httpx

from manager.launch.engine_key import bearer

SLEEP_TIMEOUT_S = 600.0  # moving a big model's weights to host RAM takes tens of seconds


async def put_to_sleep(
    http: httpx.AsyncClient, port: int, level: int, address: str = "127.0.0.1", key: str | None = None
) -> tuple[bool, float, str]:
    """``key``: the engine's API key (vLLM 0.32 does not ask for it on these endpoints; a later one may)."""
    started = time.perf_counter()
    target = f"{address}:{port}"
    # mode=wait: were a request still running (the front door drains first), let it finish.
    failure = await _post(http, target, f"/sleep?level={level}&mode=wait", key=key)
    if failure is None:
        failure = await _expect_sleeping(http, target, True, key)
    return failure is None, time.perf_counter() - started, failure or ""


async def wake_up(
    http: httpx.AsyncClient, port: int, level: int, address: str = "127.0.0.1", key: str | None = None
) -> tuple[bool, float, str]:
    started = time.perf_counter()
    target = f"{address}:{port}"
    if level >= 2:
        steps = ["/wake_up?tags=weights", "/collective_rpc", "/wake_up"]
    else:
        steps = ["/wake_up"]
    failure = None
    for path in steps:
        body = {"method": "reload_weights"} if path == "/collective_rpc" else None
        failure = await _post(http, target, path, body, key)
        if failure is not None:
            break
    if failure is None:
        failure = await _expect_sleeping(http, target, False, key)
    return failure is None, time.perf_counter() - started, failure or ""


async def _post(
    http: httpx.AsyncClient, target: str, path: str, body: dict | None = None, key: str | None = None
) -> str | None:
    """None when the engine did it, else what it said."""
    try:
        resp = await http.post(f"http://{target}{path}", json=body, headers=bearer(key), timeout=SLEEP_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"POST {path.split('?')[0]} did not answer ({type(exc).__name__}: {exc})"
    if resp.status_code == 404:
        return (
            f"POST {path.split('?')[0]} answered 404: the engine was started without sleep mode "
            "(set sleep_level in its model config and restart it)"
        )
    if resp.status_code >= 400:
        return f"POST {path.split('?')[0]} answered {resp.status_code}: {resp.text.strip()[:300]}"
    return None


async def _expect_sleeping(http: httpx.AsyncClient, target: str, wanted: bool, key: str | None) -> str | None:
    try:
        resp = await http.get(f"http://{target}/is_sleeping", headers=bearer(key), timeout=30)
        sleeping = resp.json().get("is_sleeping")
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return f"GET /is_sleeping did not answer ({type(exc).__name__})"
    if sleeping is not wanted:
        return f"GET /is_sleeping says {sleeping!r} afterwards"
    return None
