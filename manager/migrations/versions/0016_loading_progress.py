"""A model config's loading_progress: its streamed /v1 requests that wait for its start, wake or download
get SSE comment lines with the progress.

Revision ID: 0016_loading_progress
Revises: 0015_min_residency
"""

import sqlalchemy as sa
from alembic import op

revision = "0016_loading_progress"
down_revision = "0015_min_residency"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ALTER TABLE ADD COLUMN, not a batch copy: copying model_config would cascade-delete its routing names.
    op.add_column(
        "model_config", sa.Column("loading_progress", sa.Boolean(), nullable=False, server_default=sa.false())
    )


def downgrade() -> None:
    op.drop_column("model_config", "loading_progress")
