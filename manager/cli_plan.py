"""`vllm-manager plan MODEL`: the planner's table in a terminal (exit 1 when it does not fit)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:  # the planner is imported when a plan is made, not for every command's start
    from manager.planner.records import Plan

_SECTIONS = {"model": "Model", "gpu": "Device", "extend": "What would extend it", "cpu": "Host memory"}


def plan(
    model: Annotated[
        str,
        typer.Argument(
            help="Model folder, or a Hugging Face id (read from the local cache, else from the hub: config.json and "
            "the safetensors headers only, nothing downloaded)."
        ),
    ],
    gpu: Annotated[
        str, typer.Option(help='"detected", a GPU model (rtx-4090, l40s, a100-80, h100-80, h200, ...) or "cpu".')
    ] = "detected",
    max_model_len: Annotated[int | None, typer.Option(help="Context to plan for (default: the model's).")] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(help="Sequences at once (default: vLLM's for the GPU: 1024 on 70 GiB or more).")
    ] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help="auto or fp8.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Model dtype (auto: from config.json).")] = "auto",
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", "-tp")] = 1,
    gpu_memory_utilization: Annotated[float, typer.Option()] = 0.9,
    kv_offload_gib: Annotated[
        float, typer.Option(help="CPU KV offload size (prefix-cache capacity, not context).")
    ] = 0,
    moe_expert_offload: Annotated[bool, typer.Option(help="Our MoE expert offload.")] = False,
    moe_gpu_cache_gib: Annotated[float, typer.Option(help="GPU expert cache of the MoE offload.")] = 0,
    cpu_offload_gb: Annotated[float, typer.Option(help="vLLM --cpu-offload-gb.")] = 0,
    host_ram_gib: Annotated[float | None, typer.Option(help="Plan another machine's RAM.")] = None,
    enforce_eager: Annotated[bool, typer.Option(help="No CUDA graphs: their memory goes to the KV cache.")] = False,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Default: vLLM's for the device.")] = None,
    async_scheduling: Annotated[
        bool | None, typer.Option("--async-scheduling/--no-async-scheduling", help="Default: vLLM's.")
    ] = None,
    disable_hybrid_kv_cache_manager: Annotated[
        bool | None,
        typer.Option(
            "--disable-hybrid-kv-cache-manager/--no-disable-hybrid-kv-cache-manager",
            help="Default: vLLM decides from the model and the KV connector.",
        ),
    ] = None,
    kv_transfer_config: Annotated[
        str | None, typer.Option(help="vLLM's --kv-transfer-config JSON (its connector decides the KV manager).")
    ] = None,
    kv_cache_memory_gib: Annotated[
        float | None, typer.Option(help="Explicit KV budget (--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """What fits on the GPU for MODEL, why, and what would extend it."""
    from pydantic import ValidationError

    from manager.errors import ManagerError
    from manager.hub import source
    from manager.planner import PlanError, PlanRequest, make_plan

    try:
        request = PlanRequest(
            model=model,
            gpu=gpu,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_dtype=kv_cache_dtype,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_offload_gib=kv_offload_gib,
            moe_expert_offload=moe_expert_offload,
            moe_gpu_cache_gib=moe_gpu_cache_gib,
            cpu_offload_gb=cpu_offload_gb,
            host_ram_gib=host_ram_gib,
            enforce_eager=enforce_eager,
            max_num_batched_tokens=max_num_batched_tokens,
            async_scheduling=async_scheduling,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            kv_transfer_config=_json_object(kv_transfer_config),
            kv_cache_memory_gib=kv_cache_memory_gib,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        typer.echo(f"error: {'.'.join(str(p) for p in first['loc']) or 'input'}: {first['msg']}", err=True)
        raise typer.Exit(2) from exc
    try:
        result = make_plan(request, read_files=source.read_model)
    except (PlanError, ManagerError) as exc:  # ManagerError: the hub refused or did not answer
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(result.model_dump_json(indent=2) if as_json else render(result))
    if not result.verdict.fits:
        raise typer.Exit(1)


def _json_object(text: str | None) -> dict | None:
    from manager.planner.scheduling import parse_transfer_config

    if text is None:
        return None
    value = parse_transfer_config(text)
    if value is None:
        typer.echo("error: --kv-transfer-config: not a JSON object", err=True)
        raise typer.Exit(2)
    return value


def render(result: Plan) -> str:
    """The plan as a plain-text table: value, unit, label, then the explanation."""
    out = [f"Plan for {result.request.model} on {result.device}"]
    for section, title in _SECTIONS.items():
        rows = [line for line in result.lines if line.section == section]
        if not rows:
            continue
        out.append(f"\n{title}")
        for line in rows:
            value = f"{line.value:,}" if isinstance(line.value, int) else str(line.value)
            out.append(f"  {value:>12} {line.unit:<7} {line.label}")
            out.append(f"  {'':>20} {line.explanation}")
    out.append("")
    out.append(("FITS: " if result.verdict.fits else "DOES NOT FIT: ") + result.verdict.message)
    out.append(f"assumed: {result.assumptions.summary}")
    out += [f"note: {w}" for w in result.warnings]
    return "\n".join(out)


if __name__ == "__main__":  # python -m manager.cli_plan MODEL
    typer.run(plan)
