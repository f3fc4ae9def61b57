"""After a start: vLLM's own KV figures from a worker's log beside the plan for its stored config."""

from __future__ import annotations

from pathlib import Path

from sqlmodel import Session

from manager.launch.preflight import prediction_vs_engine
from manager.services import models


def worker_kv_check(db: Session, model_name: str, log_path: Path | None) -> dict:
    """For a worker: vLLM's KV figures from its current log beside the plan for its config."""
    text = log_path.read_text(errors="replace") if log_path and log_path.exists() else ""
    config = models.get_model(db, model_name)
    result = prediction_vs_engine(config, models.profile_of(db, config), text)
    return result or {"reported": None, "note": "vLLM has not logged its KV cache size for this start yet"}
