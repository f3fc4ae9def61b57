"""Replicas: how many workers run a model config, and the bounds and delays of scaling them.

Revision ID: 0011_replicas
Revises: 0010_downloads
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_replicas"
down_revision = "0010_downloads"
branch_labels = None
depends_on = None

# (name, nullable, default): mirrors the ModelConfig fields.
COLUMNS = (
    ("replicas", False, "1"),
    ("min_replicas", True, None),
    ("max_replicas", True, None),
    ("scale_up_after_s", False, "10"),
    ("scale_down_after_s", False, "300"),
)


def upgrade() -> None:
    # ALTER TABLE ADD COLUMN, not a batch copy: copying model_config would cascade-delete its routing names.
    for name, nullable, default in COLUMNS:
        op.add_column("model_config", sa.Column(name, sa.Integer(), nullable=nullable, server_default=default))


def downgrade() -> None:
    for name, _, _ in reversed(COLUMNS):
        op.drop_column("model_config", name)
