"""The audit log: one row per change asked of the manager, and what came of it.

Revision ID: 0013_audit
Revises: 0012_key_limits
"""

import sqlalchemy as sa
from alembic import op

revision = "0013_audit"
down_revision = "0012_key_limits"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Mirrors manager.schemas.audit.AuditEntry.
    op.create_table(
        "audit_entry",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("who", sa.String(), nullable=False),
        sa.Column("token", sa.String(), nullable=True),
        sa.Column("token_name", sa.String(), nullable=True),
        sa.Column("address", sa.String(), nullable=False),
        sa.Column("method", sa.String(), nullable=False),
        sa.Column("route", sa.String(), nullable=False),
        sa.Column("action", sa.String(), nullable=False),
        sa.Column("target", sa.String(), nullable=True),
        sa.Column("fields", sa.JSON(), nullable=False),
        sa.Column("changed", sa.JSON(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("message", sa.String(), nullable=True),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_audit_entry_at", "audit_entry", ["at"])


def downgrade() -> None:
    op.drop_index("ix_audit_entry_at", table_name="audit_entry")
    op.drop_table("audit_entry")
