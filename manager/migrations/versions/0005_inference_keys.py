"""Inference API keys for /v1, and its usage per minute.

Revision ID: 0005_inference_keys
Revises: 0004_front_door_fields
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_inference_keys"
down_revision = "0004_front_door_fields"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Mirrors manager.schemas.inference_key.InferenceKey and manager.schemas.usage.UsageMinute.
    op.create_table(
        "inference_key",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("sha256", sa.String(), nullable=False),
        sa.Column("prefix", sa.String(), nullable=False),
        sa.Column("models", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_used_at", sa.DateTime(), nullable=True),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_inference_key_sha256", "inference_key", ["sha256"], unique=True)
    op.create_index(
        "ix_inference_key_active_name",
        "inference_key",
        ["name"],
        unique=True,
        sqlite_where=sa.text("revoked_at IS NULL"),
    )
    op.create_table(
        "usage_minute",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("minute", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("errors", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.UniqueConstraint("minute", "key_id", "model", name="uq_usage_minute_minute_key_model"),
    )
    op.create_index("ix_usage_minute_minute", "usage_minute", ["minute"])


def downgrade() -> None:
    op.drop_index("ix_usage_minute_minute", table_name="usage_minute")
    op.drop_table("usage_minute")
    op.drop_index("ix_inference_key_active_name", table_name="inference_key")
    op.drop_index("ix_inference_key_sha256", table_name="inference_key")
    op.drop_table("inference_key")
