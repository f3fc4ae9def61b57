"""The exact command a model config launches: an argv list and an environment, never a shell string."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from engine_patches.settings import PatchSettings
from manager.errors import Invalid
from manager.hub.fetching import Fetcher
from manager.hub.model_location import download_note, downloads_forbidden, is_local_path
from manager.launch.allowed_env import env_notes
from manager.launch.engine_key import ENV_NAME, key_through_env
from manager.launch.flags import flag_value, managed_argv, quiet_paths
from manager.launch.refusals import check_engine_argv, check_expert_offload, check_launch
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile
from manager.settings import Settings

GIB = 1 << 30
ENTRY_MODULE = "vllm.entrypoints.openai.api_server"
PLUGIN_NAME = "offload_patches"  # the entry point engine_patches declares in vllm.general_plugins
VLLM_BLOCK_SIZE = 16  # vLLM's default GPU block size, which an offloaded CPU block mirrors


@dataclass
class LaunchCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def engine_argv(self) -> list[str]:
        """The arguments after `python -m vllm.entrypoints.openai.api_server`."""
        return self.argv[3:]


def served_name(config: ModelConfig) -> str:
    return config.served_model_name or config.name


def kv_offload_bytes(config: ModelConfig, profile: OffloadProfile) -> tuple[int | None, str | None]:
    """Bytes of CPU KV offload the profile asks for, and a note when it came from num_cpu_blocks."""
    if profile.kv_offload_gib is not None:
        return int(profile.kv_offload_gib * GIB), None
    if profile.kv_offload_num_cpu_blocks is None:
        return None, None
    from manager.planner.kv import kv_page_bytes, offload_cpu_bytes
    from manager.planner.model_files import find_model_folder

    blocks = profile.kv_offload_num_cpu_blocks
    try:
        folder = find_model_folder(config.model)
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise Invalid(
            f"offload profile {profile.name!r} sizes KV offload as {blocks} num_cpu_blocks, which vLLM 0.32 "
            "does not accept (it takes bytes: cpu_bytes_to_use). Converting blocks to bytes needs the "
            f"model's config.json, which could not be read ({exc}). Set kv_offload_gib in the profile instead.",
            field="kv_offload_num_cpu_blocks",
        ) from exc
    tp = config.tensor_parallel_size
    given = flag_value(config.extra_args, "--block-size") or ""
    block = int(given) if given.isdigit() and int(given) > 0 else VLLM_BLOCK_SIZE
    page = kv_page_bytes(hf_config, config.kv_cache_dtype, block, tp, config.dtype)
    total = offload_cpu_bytes(blocks, hf_config, config.kv_cache_dtype, block, tp, config.dtype)
    note = (
        f"KV offload: {blocks} num_cpu_blocks x {page} bytes per block ({block} tokens, all "
        f"layers, all TP ranks, page-aligned) = {total} bytes ({total / GIB:.3f} GiB) of prefix-cache "
        "capacity in host RAM; it does not raise max_model_len"
    )
    return total, note


def eager_by_choice(config: ModelConfig) -> bool:
    """The user runs the engine eager: the config's enforce_eager, or --enforce-eager in its extra_args."""
    return config.enforce_eager or "--enforce-eager" in config.extra_args


def adds_enforce_eager(config: ModelConfig, profile: OffloadProfile | None) -> bool:
    """The manager adds --enforce-eager: MoE expert offload sizes its CUDA graphs from the model's
    config.json, which could not be read (and the user did not ask for eager already)."""
    moe_offload = profile is not None and profile.moe_expert_offload
    return moe_offload and not eager_by_choice(config) and moe_graph_tokens(config, profile) is None


def moe_graph_tokens(config: ModelConfig, profile: OffloadProfile | None) -> int | None:
    """With MoE expert offload on: the largest batch (tokens) that may run inside a CUDA graph.

    The engine plans batches of up to max(slots/top_k, 64) tokens on the GPU, with no host reads
    (experts that find no cache slot are read in place from pinned host memory; with a pin budget
    too small for the experts, slots/top_k only), and those of up to max(slots/top_k, 16) tokens
    run inside CUDA graphs (``engine_patches.moe.sizing.graph_tokens``); a captured batch the engine
    plans on the host would stop it at start. The slots come from the same arithmetic the engine
    sizes its cache with. 0 when the model has no routed experts (offload changes nothing there); None when the model's
    config.json cannot be read: then the engine runs eager.
    """
    if profile is None or not profile.moe_expert_offload:
        return None
    from manager.planner.gpu_side import moe_offload
    from manager.planner.hf_config import text_config
    from manager.planner.model_files import find_model_folder
    from manager.planner.weights import estimate_weights

    try:
        folder = find_model_folder(config.model)
        hf_config = json.loads((folder / "config.json").read_text())
        weights = estimate_weights(hf_config, None, config.dtype)
        sizing = moe_offload(
            weights,
            text_config(hf_config),
            profile.moe_gpu_cache_gib or 0,
            config.tensor_parallel_size,
            pin_budget_bytes=pin_budget_bytes(profile),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return sizing.graph_tokens


def pin_budget_bytes(profile: OffloadProfile) -> int | None:
    """The profile's cap on each engine process's pinned host memory, in bytes; None: no cap."""
    return int(profile.pinned_budget_gib * GIB) if profile.pinned_budget_gib else None


def sleep_pool_on(config: ModelConfig, profile: OffloadProfile | None) -> bool:
    """Sleep level 1 goes through the sleep pool: on unless the worker's offload profile turns it off."""
    return config.sleep_level == 1 and (profile is None or profile.sleep_pool)


def patch_settings(profile: OffloadProfile | None, config: ModelConfig, run_dir: Path | None) -> PatchSettings:
    pool = sleep_pool_on(config, profile)
    if profile is None:
        return PatchSettings(run_dir=str(run_dir) if run_dir else None, sleep_pool=pool)
    return PatchSettings(
        run_dir=str(run_dir) if run_dir else None,
        sleep_pool=pool,
        pin_budget_bytes=pin_budget_bytes(profile),
        lora_pool=profile.lora_cpu_pooling,
        lora_pool_bytes=int(profile.lora_pool_gib * GIB) if profile.lora_pool_gib else None,
        max_cpu_loras=config.max_cpu_loras,
        moe_offload=profile.moe_expert_offload,
        moe_gpu_cache_gib=profile.moe_gpu_cache_gib,
    )


def build_command(
    config: ModelConfig,
    profile: OffloadProfile | None,
    *,
    engine_python: str,
    port: int,
    gpus: list[int] | None = None,
    run_dir: Path | None = None,
    host: str = "127.0.0.1",
    allow_code_flags: bool = False,
) -> LaunchCommand:
    """The argv (the managed flags from the flag table, then extra_args) and the environment.

    Invalid when that argv loads code (unless ``allow_code_flags``), whatever part of it says so."""
    notes: list[str] = []
    moe_offload = profile is not None and profile.moe_expert_offload
    check_expert_offload(config.extra_args, moe_offload)
    added_eager = adds_enforce_eager(config, profile)
    eager = eager_by_choice(config) or added_eager
    graph_tokens = moe_graph_tokens(config, profile) if moe_offload and not eager else None
    capture_flag: list[str] = []
    if added_eager:
        notes.append(
            "--enforce-eager added: MoE expert offload sizes its CUDA graphs from the model's config.json, "
            "which could not be read"
        )
    elif not graph_tokens:
        pass  # no routed experts in this model: nothing to offload, nothing to limit
    elif _sets_capture_sizes(config.extra_args):
        notes.append(
            f"MoE expert offload runs batches of up to {graph_tokens} tokens inside CUDA graphs by default; the "
            "CUDA graph sizes in extra_args are kept, and a captured size the engine cannot plan on the GPU "
            "stops it at start"
        )
    else:
        # Larger batches read the router's choices on the host: vLLM runs them outside graphs.
        capture_flag = ["--max-cudagraph-capture-size", str(graph_tokens)]
        notes.append(
            f"--max-cudagraph-capture-size {graph_tokens} added: MoE expert offload runs batches of up to "
            f"{graph_tokens} tokens inside CUDA graphs (experts that find no cache slot are read in place from "
            "host memory), larger ones without"
        )
    kv_size, kv_connector = None, None
    if profile is not None:
        kv_bytes, note = kv_offload_bytes(config, profile)
        if note:
            notes.append(note)
        if kv_bytes is not None and profile.kv_eviction_policy == "lru":
            kv_size = _gib_text(kv_bytes)
        elif kv_bytes is not None:
            # Only the connector's extra config carries a policy other than the default LRU.
            kv_connector = _offloading_connector(kv_bytes, profile.kv_eviction_policy)
    values = {
        **config.model_dump(),
        "served_model_name": served_name(config),
        "host": host,
        "port": port,
        "enforce_eager": config.enforce_eager or added_eager,
        "kv_offloading_size": kv_size,
        "kv_offloading_backend": "native" if kv_size is not None else None,
        "enable_sleep_mode": config.sleep_level is not None,
        "quiet_paths": quiet_paths(config.extra_args),
    }
    managed = managed_argv(values)
    # The connector's config is the manager's own, from the profile's numbers and policy.
    check_engine_argv([*managed, *capture_flag, *config.extra_args], allow_code_flags)
    argv = [engine_python, "-m", ENTRY_MODULE, *managed, *capture_flag]
    if kv_connector is not None:
        argv += ["--kv-transfer-config", kv_connector]
    # The engine's key goes through its environment: argv is readable by every local user.
    extra_args, env = key_through_env(config.extra_args, config.env)
    argv += extra_args

    notes += env_notes(env)
    if gpus:
        visible = ",".join(str(g) for g in gpus)
        if env.get("CUDA_VISIBLE_DEVICES", visible) != visible:
            notes.append(
                f"CUDA_VISIBLE_DEVICES={visible} (the worker's GPUs) replaces {env['CUDA_VISIBLE_DEVICES']} from env"
            )
        env["CUDA_VISIBLE_DEVICES"] = visible
    # VLLM_PLUGINS is an allow-list: keep what the config already allows and add ours.
    plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
    env["VLLM_PLUGINS"] = ",".join(plugins + [PLUGIN_NAME] * (PLUGIN_NAME not in plugins))
    env.update(patch_settings(profile, config, run_dir).to_env())
    if config.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if config.sleep_level is not None:
        # vLLM serves /sleep, /wake_up and /is_sleeping only in its dev mode. Those endpoints (and the
        # other dev ones) must stay on loopback: the front door never forwards them.
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if host not in ("127.0.0.1", "localhost", "::1"):
            notes.append(
                f"sleep mode needs vLLM's dev endpoints (/sleep, /wake_up, /collective_rpc, ...); this engine "
                f"binds {host}, so anyone who reaches its port can call them"
            )
    return LaunchCommand(argv=argv, env=env, notes=notes)


def _sets_capture_sizes(extra_args: list[str]) -> bool:
    """Whether extra_args choose CUDA graph sizes themselves (a flag or a compilation config)."""
    return any("cudagraph" in arg.lower().replace("-", "").replace("_", "") for arg in extra_args)


def _offloading_connector(kv_bytes: int, eviction_policy: str) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": kv_bytes, "eviction_policy": eviction_policy},
        }
    )


def _gib_text(n_bytes: int) -> str:
    # n / 2**30 is exact in a float for any realistic size, and vLLM multiplies it back by 2**30,
    # so the engine gets exactly n_bytes.
    gib = n_bytes / GIB
    return str(int(gib)) if gib.is_integer() else repr(gib)


def preview_command(
    config: ModelConfig, profile: OffloadProfile | None, settings: Settings, fetcher: Fetcher | None = None
) -> LaunchCommand:
    """The command a start of this config would run now, for previews (its own port, or the range's first);
    with the manager's downloads (``fetcher``), as a start on this machine meets its hub model.

    A config the code-loading rules refuse is refused here too: vLLM's parser, which checks a preview,
    already imports some of what those rules keep out (a compilation config's inductor_passes)."""
    check_launch(config, settings.allow_code_flags)
    cmd = build_command(
        config,
        profile,
        engine_python=settings.engine_python,
        port=config.port or settings.worker_port_range.start,
        gpus=config.gpu_ids,
        run_dir=settings.run_dir / "preview",
        host=settings.worker_host,
        allow_code_flags=settings.allow_code_flags,
    )
    if settings.local_model_paths and fetcher is not None:
        downloads_first(cmd, config, fetcher)
    elif settings.local_model_paths and (download := download_note(config.model, config.env)):
        cmd.notes.append(download)
    return cmd


def needs_download(config: ModelConfig, fetcher: Fetcher) -> bool:
    """Whether a start of ``config`` on this machine downloads its hub model before the engine starts."""
    if is_local_path(config.model) or downloads_forbidden(config.env):
        return False  # a folder, or an engine that may not download (its start is checked for that)
    return fetcher.needed(config.model, config.env)


def downloads_first(cmd: LaunchCommand, config: ModelConfig, fetcher: Fetcher, needed: bool | None = None) -> bool:
    """Whether a start of ``config`` on this machine downloads its hub model before the engine starts
    (said in the notes). A model complete in the cache is loaded offline (HF_HUB_OFFLINE=1, unless the
    config's env sets it), so the engine's start asks the Hub nothing and start_timeout_s is the start alone.
    ``needed``: what ``needs_download`` answered for this start, when it was asked already."""
    if is_local_path(config.model) or downloads_forbidden(config.env):
        return False
    if needs_download(config, fetcher) if needed is None else needed:
        timeout = config.download_timeout_s
        limit = f"within download_timeout_s ({timeout} s)" if timeout else "with no time limit"
        cmd.notes.append(
            f"{config.model} is downloaded from the Hugging Face Hub before vLLM starts ({limit}); "
            "start_timeout_s counts from the engine's start"
        )
        return True
    if "HF_HUB_OFFLINE" not in config.env:
        cmd.env["HF_HUB_OFFLINE"] = "1"
        cmd.notes.append(
            f"HF_HUB_OFFLINE=1: {config.model} is complete in the Hugging Face cache, so vLLM loads it without "
            "asking the Hub"
        )
    return False


def inherited_env() -> dict[str, str]:
    """The manager's environment as an engine gets it: without the manager's own settings, which hold
    its API token and mean nothing to vLLM (which warns about every unknown VLLM_* name it sees), and
    without a VLLM_API_KEY of its own: an engine asks for its config's key, the one the manager sends."""
    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MANAGER_") and k != ENV_NAME}
