"""Fixtures for the planner tests: real config.json files of real models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"


def load_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.fixture
def model_config():
    return load_config
