"""The honest memory and context planner: what fits, why, and what would extend it.

Pure Python (no FastAPI, torch or vllm): routes, the CLI and the supervisor are thin users.
"""

from manager.planner.engine_report import compare, parse_engine_kv_report
from manager.planner.kv import kv_bytes_per_token, kv_page_bytes, offload_cpu_bytes
from manager.planner.plan import PlanError, check_fits, make_plan
from manager.planner.records import Comparison, EngineKVReport, Plan, PlanLine, PlanRequest, Verdict, WayOut

__all__ = [
    "Comparison",
    "EngineKVReport",
    "Plan",
    "PlanError",
    "PlanLine",
    "PlanRequest",
    "Verdict",
    "WayOut",
    "check_fits",
    "compare",
    "kv_bytes_per_token",
    "kv_page_bytes",
    "make_plan",
    "offload_cpu_bytes",
    "parse_engine_kv_report",
]
