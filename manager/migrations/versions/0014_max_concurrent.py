"""A model config's max_concurrent: the most /v1 requests it answers at once; more wait in the front door.

Revision ID: 0014_max_concurrent
Revises: 0013_audit
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_max_concurrent"
down_revision = "0013_audit"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ALTER TABLE ADD COLUMN, not a batch copy: copying model_config would cascade-delete its routing names.
    op.add_column("model_config", sa.Column("max_concurrent", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("model_config", "max_concurrent")
