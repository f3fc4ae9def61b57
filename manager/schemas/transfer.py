"""The export file: every offload profile and model config, as GET /api/export writes it and POST
/api/import reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from manager.schemas.model_config import ModelConfigCreate
from manager.schemas.offload_profile import OffloadProfileCreate


class ExportFile(BaseModel):
    format: Literal["vllm-manager"]
    version: Literal[1] = Field(description="The version of the file format")
    profiles: list[OffloadProfileCreate] = Field(default_factory=list)
    models: list[ModelConfigCreate] = Field(
        default_factory=list, description="Their offload profiles must be stored or in the file"
    )
