"""A model config's min_residency_s: how long /v1 keeps a model it swapped in before another may evict it.

Revision ID: 0015_min_residency
Revises: 0014_max_concurrent
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_min_residency"
down_revision = "0014_max_concurrent"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ALTER TABLE ADD COLUMN, not a batch copy: copying model_config would cascade-delete its routing names.
    op.add_column("model_config", sa.Column("min_residency_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("model_config", "min_residency_s")
