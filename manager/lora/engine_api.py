"""vLLM's runtime LoRA endpoints on one worker (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).

``POST /v1/load_lora_adapter {lora_name, lora_path}``, ``POST /v1/unload_lora_adapter
{lora_name}``; loaded adapters appear in ``GET /v1/models`` with their base model as ``parent``.
An engine started with an API key asks for it on all three (``key``).
"""

from __future__ import annotations

import time

import httpx

from manager.errors import Conflict, Invalid, ManagerError, NotFound
from manager.launch.engine_key import bearer
from manager.lora.records import LoadedAdapter

LOOPBACK = "127.0.0.1"


class EngineUnreachable(ManagerError):
    status = 502


def _url(port: int, path: str, address: str) -> str:
    return f"http://{address}:{port}{path}"


def _engine_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(body.get("message") or body.get("detail") or body)[:500]


async def _post(
    http: httpx.AsyncClient, port: int, path: str, body: dict, timeout: float, address: str, key: str | None
) -> httpx.Response:
    try:
        return await http.post(_url(port, path, address), json=body, headers=bearer(key), timeout=timeout)
    except httpx.HTTPError as exc:
        raise EngineUnreachable(f"the worker on port {port} did not answer {path} ({exc})") from exc


async def load(
    http: httpx.AsyncClient,
    port: int,
    name: str,
    path: str,
    timeout: float = 600.0,
    address: str = LOOPBACK,
    key: str | None = None,
) -> float:
    """Load the adapter; returns the seconds the engine took (read from disk into its cache)."""
    started = time.perf_counter()
    body = {"lora_name": name, "lora_path": path}
    resp = await _post(http, port, "/v1/load_lora_adapter", body, timeout, address, key)
    seconds = time.perf_counter() - started
    if resp.status_code == 404:
        raise Invalid(
            f"the worker on port {port} has no runtime LoRA endpoints: start it from a "
            f"model config with enable_lora on (the manager then sets "
            f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)"
        )
    if resp.status_code >= 400:
        message = _engine_message(resp)
        if "already been loaded" in message:
            raise Conflict(f"adapter {name!r} is already loaded on the worker on port {port}")
        raise Invalid(f"vLLM refused to load adapter {name!r} from {path}: {message}")
    return seconds


async def unload(
    http: httpx.AsyncClient,
    port: int,
    name: str,
    timeout: float = 120.0,
    address: str = LOOPBACK,
    key: str | None = None,
) -> None:
    resp = await _post(http, port, "/v1/unload_lora_adapter", {"lora_name": name}, timeout, address, key)
    if resp.status_code == 404 and "cannot be found" not in resp.text:
        raise Invalid(f"the worker on port {port} has no runtime LoRA endpoints (enable_lora off?)")
    if resp.status_code >= 400:
        message = _engine_message(resp)
        if "cannot be found" in message:
            raise NotFound(f"adapter {name!r} is not loaded on the worker on port {port}")
        raise Invalid(f"vLLM refused to unload adapter {name!r}: {message}")


async def loaded(
    http: httpx.AsyncClient, port: int, timeout: float = 10.0, address: str = LOOPBACK, key: str | None = None
) -> list[LoadedAdapter]:
    """The adapters the worker serves now (entries of /v1/models that have a parent)."""
    try:
        resp = await http.get(_url(port, "/v1/models", address), headers=bearer(key), timeout=timeout)
        resp.raise_for_status()
        entries = resp.json().get("data", [])
    except (httpx.HTTPError, ValueError) as exc:
        raise EngineUnreachable(f"could not list models on the worker on port {port} ({exc})") from exc
    return [
        LoadedAdapter(name=e["id"], path=str(e.get("root") or ""), base_model=str(e["parent"]))
        for e in entries
        if e.get("parent")
    ]
