"""A worker's waits_for_node: it failed because the live nodes could not hold its restart, and starts
again when a lost node is back (kept across manager restarts).

Revision ID: 0017_waits_for_node
Revises: 0016_loading_progress
"""

import sqlalchemy as sa
from alembic import op

revision = "0017_waits_for_node"
down_revision = "0016_loading_progress"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("worker", sa.Column("waits_for_node", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    op.drop_column("worker", "waits_for_node")
