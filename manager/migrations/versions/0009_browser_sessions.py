"""Browser sessions kept by the manager (logging out ends one), and whether /v1 was opened again after
its inference keys were revoked.

Revision ID: 0009_browser_sessions
Revises: 0008_routing_names
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_browser_sessions"
down_revision = "0008_routing_names"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Mirrors manager.schemas.browser_session.BrowserSession and manager.schemas.inference_key.InferenceAccess.
    op.create_table(
        "browser_session",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("secret_sha256", sa.String(), nullable=False),
        sa.Column("token_sha256", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(), nullable=False),
        sa.Column("client_address", sa.String(), nullable=False),
        sa.Column("user_agent", sa.String(), nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_browser_session_token_sha256", "browser_session", ["token_sha256"])
    op.create_table(
        "inference_access",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("open_without_keys", sa.Boolean(), nullable=False),
        sa.Column("changed_at", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("inference_access")
    op.drop_index("ix_browser_session_token_sha256", table_name="browser_session")
    op.drop_table("browser_session")
