"""Limits of inference keys: requests and tokens per minute, requests in flight, a token budget per day
or month, when the key expires, and its priority.

Revision ID: 0012_key_limits
Revises: 0011_replicas
"""

import sqlalchemy as sa
from alembic import op

revision = "0012_key_limits"
down_revision = "0011_replicas"
branch_labels = None
depends_on = None

# (column, type, nullable, default): mirrors the KeyLimitFields of InferenceKey.
COLUMNS = (
    ("rpm", sa.Integer(), True, None),
    ("tpm", sa.Integer(), True, None),
    ("max_concurrent", sa.Integer(), True, None),
    ("token_budget", sa.Integer(), True, None),
    ("budget_period", sa.String(), False, "month"),
    ("expires_at", sa.DateTime(), True, None),
    ("priority", sa.String(), False, "interactive"),
)


def upgrade() -> None:
    for name, kind, nullable, default in COLUMNS:
        op.add_column("inference_key", sa.Column(name, kind, nullable=nullable, server_default=default))


def downgrade() -> None:
    for name, _, _, _ in reversed(COLUMNS):
        op.drop_column("inference_key", name)
