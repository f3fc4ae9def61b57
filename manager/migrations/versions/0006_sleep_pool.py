"""Offload profiles: the sleep pool switch (on by default).

Revision ID: 0006_sleep_pool
Revises: 0005_inference_keys
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_sleep_pool"
down_revision = "0005_inference_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("offload_profile") as batch:
        batch.add_column(sa.Column("sleep_pool", sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table("offload_profile") as batch:
        batch.drop_column("sleep_pool")
