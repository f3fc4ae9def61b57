"""The shapes of error answers: one for the manager's own API, OpenAI's for /v1."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FieldError(BaseModel):
    """One part of a request that failed validation."""

    loc: list[str | int] = Field(description='Where: "body", "path", "query" or "header", then the field names')
    msg: str = Field(description="What is wrong with it")
    type: str = Field(description="The rule it broke, e.g. string_too_long")


class ErrorBody(BaseModel):
    """Every error the manager's API answers with. Some errors add fields of their own beside these
    (a rejected command its ``argv``, a refused start its ``ways_out``)."""

    model_config = ConfigDict(extra="allow")

    detail: str = Field(description="What was wrong and what to do about it")
    errors: list[FieldError] | None = Field(
        default=None, description="Validation failures (422 for a request that does not match this schema): each field"
    )


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, ...")
    param: str | None = Field(description="The request field at fault, when one is")
    code: str | None = Field(description="model_not_found, queue_full, model_unavailable, ...")


class OpenAIError(BaseModel):
    """The error shape of OpenAI's API, which its client libraries read; /v1 answers in it."""

    error: OpenAIErrorDetail
