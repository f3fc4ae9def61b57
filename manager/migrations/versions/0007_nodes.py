"""Ray clusters: a model config's node, and the node and run folder of each worker.

Revision ID: 0007_nodes
Revises: 0006_sleep_pool
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_nodes"
down_revision = "0006_sleep_pool"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("model_config") as batch:
        batch.add_column(sa.Column("node", sa.String(), nullable=True))
    with op.batch_alter_table("worker") as batch:
        batch.add_column(sa.Column("node", sa.String(), nullable=True))
        batch.add_column(sa.Column("run_dir", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("worker") as batch:
        batch.drop_column("run_dir")
        batch.drop_column("node")
    with op.batch_alter_table("model_config") as batch:
        batch.drop_column("node")
