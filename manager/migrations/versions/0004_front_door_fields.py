"""Model config fields of the front door (/v1): aliases, idle timeout, persistent, sleep level.

Revision ID: 0004_front_door_fields
Revises: 0003_lora_adapters
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_front_door_fields"
down_revision = "0003_lora_adapters"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Mirrors the new fields of manager.schemas.model_config.ModelConfigFields; stored configs get
    # the defaults (no aliases, never idle-stopped, evictable, no sleep mode).
    with op.batch_alter_table("model_config") as batch:
        batch.add_column(sa.Column("aliases", sa.JSON(), nullable=False, server_default=sa.text("'[]'")))
        batch.add_column(sa.Column("idle_timeout_s", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("persistent", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("sleep_level", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("model_config") as batch:
        for column in ("sleep_level", "persistent", "idle_timeout_s", "aliases"):
            batch.drop_column(column)
