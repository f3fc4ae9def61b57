"""What a model config's extra_args and env may not hold: flags the manager sets, and code loading.

Checked when a config is written or imported, and again before it is started or previewed, with the
values the manager writes itself: a stored config that a newer rule refuses stays stored and listed,
and says why when it is used. The finished engine argv is checked once more for code loading.
"""

from __future__ import annotations

from manager.errors import Invalid, WaitsForNodes
from manager.launch.allowed_env import check_env
from manager.launch.arg_values import check_arg_values
from manager.launch.flags import MANAGED_FLAGS, WRITTEN_FLAGS, flag_name
from manager.schemas.engine_values import TEXT_FIELDS, engine_gpus, flag_like_problem, gpus_problem
from manager.schemas.model_config import ModelConfig

# Flags that make vLLM import or run code named by the user (a class path, a module, a plugin file,
# remote model code). Refused unless the operator turns on allow_code_flags.
CODE_FLAGS = {
    "--trust-remote-code": "runs Python code shipped with the model",
    "--worker-cls": "loads a worker class from a module path",
    "--worker-extension-cls": "loads a worker extension class from a module path",
    "--scheduler-cls": "loads a scheduler class from a module path",
    "--middleware": "imports ASGI middleware from a module path",
    "--tool-parser-plugin": "executes a Python file as a tool parser plugin",
    "--reasoning-parser-plugin": "executes a Python file as a reasoning parser plugin",
    "--logits-processors": "imports logits processors from module paths",
    "--io-processor-plugin": "loads an IO processor plugin",
    "--model-class-overrides": "replaces model classes with ones from module paths",
    "--log-config-file": "loads a logging configuration that can name handler classes",
    "--distributed-executor-backend": "can name an executor class path (ray, mp, uni and external_launcher are "
    "allowed)",
    "--config": "reads further arguments from a file, which could set any flag refused here",
}


# Code flags whose value may also be one of vLLM's own names, which load nothing of the user's.
BUILTIN_VALUES = {"--distributed-executor-backend": ("ray", "mp", "uni", "external_launcher")}


def _loads_code(code: str, args: list[str], i: int) -> bool:
    """Whether ``args[i]`` (the code flag ``code``) loads code: any value but one of vLLM's own names."""
    names = BUILTIN_VALUES.get(code)
    if names is None:
        return True
    arg = args[i]
    value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else None)
    return value not in names


def _canonical(flag: str) -> str:
    # vLLM's parser accepts --some_flag for --some-flag.
    return flag[:2] + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def _protected_by(flag: str, table: dict[str, str]) -> str | None:
    """The protected flag that `flag` names: itself, or one it abbreviates (argparse accepts any
    unambiguous prefix, so --trust-remote means --trust-remote-code)."""
    if flag in table:
        return flag
    if flag.startswith("--") and len(flag) > 3:
        for name in table:
            if name.startswith(flag):
                return name
    return None


def check_extra_args(args: list[str], allow_code_flags: bool) -> None:
    """Refuse flags that run user-chosen code (unless allowed) and flags the config already owns."""
    for i, arg in enumerate(args):
        flag = flag_name(arg)
        if flag is None:
            continue
        # vLLM sets one key of a JSON flag with --flag.key value: the flag is what counts.
        flag = _canonical(flag).split(".", 1)[0]
        base = "--" + flag[5:] if flag.startswith("--no-") else flag
        managed = _protected_by(flag, MANAGED_FLAGS) or _protected_by(base, MANAGED_FLAGS)
        if managed:
            raise Invalid(
                f"extra_args: {arg.split('=', 1)[0]} sets {managed}, which is set by the manager; "
                f"use the config field {MANAGED_FLAGS[managed]} instead",
                field="extra_args",
            )
        code = _protected_by(flag, CODE_FLAGS)
        if code and not allow_code_flags and _loads_code(code, args, i):
            raise Invalid(
                f"extra_args: {arg.split('=', 1)[0]} is refused because {code} {CODE_FLAGS[code]}; an "
                "operator can allow such flags with VLLM_MANAGER_ALLOW_CODE_FLAGS=1",
                field="extra_args",
            )
    check_arg_values(args, allow_code_flags)


def check_launch_fields(extra_args: list[str], env: dict[str, str], allow_code_flags: bool) -> None:
    """Refuse (422) what a config may not launch with: flags the manager sets, and code loading in
    extra_args (whole flags, JSON keys) or env (anything off the allow-list)."""
    check_extra_args(extra_args, allow_code_flags)
    check_env(env, allow_code_flags)


def check_launch(config: ModelConfig, allow_code_flags: bool) -> None:
    """Refuse (422) to start or preview a stored config that the write rules would refuse now: code
    loading in extra_args or env, a field value the engine would read as a flag, more GPUs than any
    cluster has (a config stored before these rules, or straight into the database)."""
    check_launch_fields(config.extra_args, config.env, allow_code_flags)
    for field in TEXT_FIELDS:
        problem = flag_like_problem(field, getattr(config, field))
        if problem:
            raise Invalid(problem, field=field)
    problem = gpus_problem(config.tensor_parallel_size, config.extra_args)
    if problem:
        raise Invalid(problem, field="tensor_parallel_size")


# vLLM's flags with which it places whole experts on the GPUs itself.
EXPERT_PLACING_FLAGS = {
    "--enable-expert-parallel": "splits whole experts between the GPUs",
    "-ep": "splits whole experts between the GPUs",
    "--enable-eplb": "moves experts between the GPUs",
}


def check_expert_offload(extra_args: list[str], moe_offload: bool) -> None:
    """Refuse (422) MoE expert offload beside a flag with which vLLM places the experts itself: the
    engine keeps every expert on its GPU then, and the plan (host copies, a GPU cache) would be wrong."""
    if not moe_offload:
        return
    for arg in extra_args:
        flag = flag_name(arg)
        # As check_extra_args reads a flag: --some_flag for --some-flag, and any unambiguous prefix.
        placing = _protected_by(_canonical(flag), EXPERT_PLACING_FLAGS) if flag is not None else None
        if placing:
            raise Invalid(
                f"extra_args: {flag} lets vLLM place the experts on the GPUs itself (it "
                f"{EXPERT_PLACING_FLAGS[placing]}), so the offload "
                "profile's MoE expert offload would not apply and the plan would be wrong; turn "
                f"moe_expert_offload off in the profile, or drop {flag}",
                field="extra_args",
            )


def check_gpus_known(
    config: ModelConfig,
    known: int | None,
    holder: str,
    lost: tuple[str, ...] = (),
    each: dict[str, int] | None = None,
) -> None:
    """Refuse (422) a start that needs more GPUs than there are (``known``; None: not known), on one
    machine or on the live nodes of a Ray cluster together, a model spread over nodes included.
    ``holder``: who has them, with its verb ("this machine has"); ``each``: a cluster's live nodes and
    their GPUs, named in the message. With nodes of the cluster ``lost``, the start waits for them
    instead (WaitsForNodes): they may bring the GPUs that are missing. Ray lists a lost node without
    its GPUs, so whether they would be enough is not known; a node gone for good stays lost, and the
    message still names the smaller config."""
    needed = engine_gpus(config.tensor_parallel_size, config.extra_args)
    if known is None or needed <= known:
        return
    nodes = f" ({', '.join(f'{node}: {gpus}' for node, gpus in sorted(each.items()))})" if each else ""
    if lost:
        raise WaitsForNodes(
            f"{config.name} needs {needed} GPUs and {holder} {known}{nodes}, with node{'s' if len(lost) > 1 else ''} "
            f"{', '.join(lost)} lost "
            "(or lower tensor_parallel_size)",
            field="tensor_parallel_size",
        )
    raise Invalid(
        f"{config.name} needs {needed} GPUs (tensor x pipeline x data parallel size) and {holder} {known}{nodes}: "
        "lower tensor_parallel_size (or the parallel sizes in extra_args)",
        field="tensor_parallel_size",
    )


def check_engine_argv(argv: list[str], allow_code_flags: bool) -> None:
    """The engine argv as it will run (the flags the manager writes, then extra_args), checked for code
    loading as extra_args are: whatever reaches vLLM's parser has passed this check."""
    if allow_code_flags:
        return
    for i, arg in enumerate(argv):
        flag = flag_name(arg)
        if flag is None or flag in WRITTEN_FLAGS:
            continue  # a flag the manager writes is itself, not the start of a longer one
        flag = _canonical(flag).split(".", 1)[0]
        code = _protected_by(flag, CODE_FLAGS)
        if code and _loads_code(code, argv, i):
            raise Invalid(
                f"the engine's command line: {arg.split('=', 1)[0]} is refused because {code} {CODE_FLAGS[code]}; "
                "an operator can allow such flags with VLLM_MANAGER_ALLOW_CODE_FLAGS=1",
                field="extra_args",
            )
    check_arg_values(argv, allow_code_flags)
