"""vLLM general plugin ``offload_patches`` (entry point ``engine_patches.plugin:register``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers) and when
it builds its argument parser, so it is idempotent, cheap, initialises no CUDA and never raises:
a broken patch must cost its feature, not the engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from engine_patches import stats
from engine_patches.settings import PatchSettings, SettingsError

logger = logging.getLogger("engine_patches")

SUPPORTED_SERIES = "0.32."

_installed: list[str] | None = None


def installed_patches() -> list[str]:
    """What this process patched ("Class.function" names); empty before register()."""
    return list(_installed or [])


def register() -> None:
    global _installed
    if _installed is not None:
        return
    _installed = []
    try:
        _route_logs_through_vllm()
        _register()
    except Exception:
        logger.exception("engine_patches: registration failed; the engine runs without patches")


def vllm_version() -> str:
    try:
        from vllm.version import __version__
    except Exception:
        return "unknown"
    return str(__version__)


def _register() -> None:
    try:
        settings = PatchSettings.from_env()
    except SettingsError as exc:
        logger.warning("engine_patches: %s; no patches applied", exc)
        return
    version = vllm_version()
    if not version.startswith(SUPPORTED_SERIES):
        logger.warning(
            "engine_patches supports vLLM %sx and this is vLLM %s: no patches applied (the engine runs as stock vLLM)",
            SUPPORTED_SERIES,
            version,
        )
        return

    stats.configure(settings.run_dir)
    allocator = _configure_allocator(settings)

    steps: list[tuple[bool, str, Callable[[], list[str]]]] = [
        (settings.pinned, "pinned", lambda: _pinning(allocator)),
        (settings.kv_check, "kv_check", _kv_check),
        (settings.shm_check, "shm_check", _shm_check),
        (settings.offload_config, "offload_config", _offload_config),
        (settings.lora_pool, "lora_pool", lambda: _lora_pool(settings, allocator)),
        (settings.moe_offload, "moe_offload", lambda: _moe(settings)),
        (settings.sleep_pool, "sleep_pool", lambda: _sleep_pool(settings, allocator)),
        (True, "routing_standin", _routing_standin),  # patches only when vLLM's simulator names it
    ]
    for enabled, name, install in steps:
        if not enabled:
            continue
        try:
            _installed.extend(install())  # type: ignore[union-attr]
        except Exception:
            logger.exception("engine_patches: the %s patch failed to install; it is off", name)

    stats.publish("plugin", {"vllm_version": version, "patches": installed_patches(), "settings": settings.to_dict()})
    logger.info(
        "engine_patches: offload_patches active in pid %d (%s), patched: %s",
        os.getpid(),
        stats.snapshot()["role"],
        ", ".join(installed_patches()) or "nothing",
    )


def _configure_allocator(settings: PatchSettings):  # -> PinnedAllocator, torch imported lazily
    from engine_patches import pinned

    def publish(s: pinned.PinnedStats) -> None:
        stats.publish("pinned", s.as_dict())

    allocator = pinned.configure_default(
        budget_bytes=settings.pin_budget_bytes, chunk_bytes=settings.pin_chunk_bytes, on_change=publish
    )
    publish(allocator.stats())
    return allocator


def _pinning(allocator) -> list[str]:
    from engine_patches.vllm_adapters import pinning

    return pinning.install_lora(allocator) + pinning.install_uva(allocator)


def _kv_check() -> list[str]:
    from engine_patches.vllm_adapters import kv_check

    return kv_check.install()


def _shm_check() -> list[str]:
    from engine_patches.vllm_adapters import offload_region

    return offload_region.install_shm_check()


def _offload_config() -> list[str]:
    from engine_patches.vllm_adapters import offload_region

    return offload_region.install_config_conversion()


def _lora_pool(settings: PatchSettings, allocator) -> list[str]:
    from engine_patches.vllm_adapters import lora_pool

    return lora_pool.install(settings, allocator)


def _moe(settings: PatchSettings) -> list[str]:
    from engine_patches.vllm_adapters import moe

    _one_triton_cache()
    return moe.install(settings)


def _one_triton_cache() -> None:
    """Give every start of the engine one Triton cache, unless its environment names one.

    The offload compiles its kernels while the engine starts (the GPU planner's, vLLM's expert kernel
    for every batch size): about 40 s on an H200 the first time. vLLM points Triton's cache at its
    model's compile folder only in a start that compiles the model, not in one that loads the model
    from its compile cache, so the second start on an H200 compiled them all again. Triton's own default
    folder, named here, serves both kinds of start; vLLM keeps a cache folder its caller names."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(home, ".triton", "cache")


def _routing_standin() -> list[str]:
    from engine_patches.vllm_adapters import routing_standin

    return routing_standin.install()


def _sleep_pool(settings: PatchSettings, allocator) -> list[str]:
    from engine_patches import pinned
    from engine_patches.vllm_adapters import sleep_pool

    # The pool is sized by the weights and counted on a plan line of its own: the profile's pin
    # budget (for LoRA, UVA offload and the like) does not cap it.
    own = pinned.PinnedAllocator(chunk_bytes=settings.pin_chunk_bytes, registrar=allocator.registrar)
    return sleep_pool.install(settings, own)


def _route_logs_through_vllm() -> None:
    """Print our log lines with vLLM's handlers and format, so they land in the engine's log."""
    ours = logging.getLogger("engine_patches")
    if ours.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
