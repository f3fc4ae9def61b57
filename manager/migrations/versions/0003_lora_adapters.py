"""LoRA adapter registry.

Revision ID: 0003_lora_adapters
Revises: 0002_metric_history
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_lora_adapters"
down_revision = "0002_metric_history"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Mirrors manager.schemas.lora_adapter.LoraAdapter.
    op.create_table(
        "lora_adapter",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("base_config", sa.String(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("last_load_s", sa.Float(), nullable=True),
        sa.Column("last_loaded_at", sa.DateTime(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_lora_adapter_name", "lora_adapter", ["name"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_lora_adapter_name", table_name="lora_adapter")
    op.drop_table("lora_adapter")
