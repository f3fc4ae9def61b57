"""Metric history: one downsampled row per series per minute.

Revision ID: 0002_metric_history
Revises: 0001_initial
"""

import sqlalchemy as sa
from alembic import op

revision = "0002_metric_history"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Mirrors manager.metrics.history.MetricHistory.
    op.create_table(
        "metric_history",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("series", sa.String(), nullable=False),
        sa.Column("minute", sa.Integer(), nullable=False),
        sa.Column("mean", sa.Float(), nullable=False),
        sa.Column("low", sa.Float(), nullable=False),
        sa.Column("high", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.UniqueConstraint("series", "minute", name="uq_metric_history_series_minute"),
    )
    op.create_index("ix_metric_history_minute", "metric_history", ["minute"])


def downgrade() -> None:
    op.drop_index("ix_metric_history_minute", table_name="metric_history")
    op.drop_table("metric_history")
