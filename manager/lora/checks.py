"""Checks an adapter must pass before it enters the registry.

The same things vLLM would refuse at load time, said earlier and in the user's terms: the folder
is a PEFT LoRA adapter (adapter_config.json and weights), its rank fits the model config's
max_lora_rank, and every module it targets exists in the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from manager.errors import Invalid
from manager.planner.model_files import ModelNotFound, find_model_folder, read_safetensors_header
from manager.schemas.common import expand_home
from manager.schemas.model_config import ModelConfig

VLLM_DEFAULT_MAX_LORA_RANK = 16  # LoRAConfig.max_lora_rank in vLLM 0.32
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")

# Module names per model family, for models whose folder has no weights to read them from
# (served with --load-format dummy, or not downloaded yet).
_LLAMA_LIKE = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"}
)
FAMILY_MODULES: dict[str, frozenset[str]] = {
    **{
        t: _LLAMA_LIKE
        for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "olmo2")
    },
    **{t: _LLAMA_LIKE | {"gate", "shared_expert_gate"} for t in ("qwen2_moe", "qwen3_moe")},
    "mixtral": frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3", "gate", "embed_tokens", "lm_head"}),
    "phi3": frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"}),
}


@dataclass(frozen=True)
class AdapterCheck:
    rank: int
    targets: tuple[str, ...]
    note: str | None = None  # something we could not check, said plainly


def check_adapter(path: str, config: ModelConfig) -> AdapterCheck:
    """Raise Invalid (with what to do) unless ``path`` is an adapter ``config`` can serve."""
    folder = expand_home(path)
    if not config.enable_lora:
        raise Invalid(
            f"model config {config.name!r} has enable_lora off: turn it on (and set "
            f"max_lora_rank) before adding adapters for it"
        )
    if not folder.is_dir():
        raise Invalid(
            f"{folder} is not a folder on the manager's machine: give the path of the "
            f"adapter folder (the one holding adapter_config.json)"
        )
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise Invalid(f"{folder} has no adapter_config.json: it is not a PEFT LoRA adapter folder")
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise Invalid(f"{folder} has adapter_config.json but no weights ({', '.join(WEIGHT_FILES)})")
    try:
        peft = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise Invalid(f"{config_file} is not valid JSON: {exc}") from exc
    if str(peft.get("peft_type", "LORA")).upper() != "LORA":
        raise Invalid(f"{config_file} is a {peft.get('peft_type')} adapter; vLLM serves LoRA only")

    rank = _rank(peft, config_file)
    limit = config.max_lora_rank or VLLM_DEFAULT_MAX_LORA_RANK
    if rank > limit:
        raise Invalid(
            f"adapter rank {rank} is above model config {config.name!r}'s "
            f"max_lora_rank {limit}: raise max_lora_rank to at least {rank} "
            f"(it sizes the GPU LoRA buffers) or use a lower-rank adapter"
        )

    targets = peft.get("target_modules")
    known = known_modules(config.model)
    if known is None:
        return AdapterCheck(
            rank,
            _as_tuple(targets),
            note=f"could not tell which modules {config.model} has (no weights "
            f"and an unknown model type): target modules not checked",
        )
    unknown = _unknown_targets(targets, known)
    if unknown:
        raise Invalid(
            f"adapter targets modules the model {config.model} does not have: "
            f"{', '.join(unknown)} (it has {', '.join(sorted(known))}); was it trained "
            f"for another base model?"
        )
    return AdapterCheck(rank, _as_tuple(targets))


def _rank(peft: dict, where: Path) -> int:
    rank = peft.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise Invalid(f"{where}: 'r' (the LoRA rank) must be a positive integer, got {rank!r}")
    pattern = peft.get("rank_pattern") or {}
    ranks = [r for r in pattern.values() if isinstance(r, int)]
    return max([rank, *ranks])


def _as_tuple(targets: object) -> tuple[str, ...]:
    if isinstance(targets, str):
        return (targets,)
    if isinstance(targets, list | tuple | set | frozenset):
        return tuple(str(t) for t in targets)
    return ()


def _unknown_targets(targets: object, known: frozenset[str]) -> list[str]:
    if targets is None or targets == "all-linear":
        return []
    if isinstance(targets, str):  # PEFT treats a string as a regex over module names
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            return [f"{targets!r} (not a valid regex: {exc})"]
        matches = any(pattern.fullmatch(m) or pattern.search(rf".{m}") for m in known)
        return [] if matches else [targets]
    # A list entry may be a suffix ("self_attn.q_proj"); its last part names the module.
    return [t for t in _as_tuple(targets) if t.rsplit(".", 1)[-1] not in known]


def known_modules(model: str) -> frozenset[str] | None:
    """Names of the model's modules: from its weight files, else from its model type."""
    try:
        folder = find_model_folder(model)
    except ModelNotFound:
        return None
    names: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        for tensor in read_safetensors_header(path):
            parts = tensor.split(".")
            if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
                names.add(parts[-2])
    if names:
        return frozenset(names)
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    return FAMILY_MODULES.get(model_type)
