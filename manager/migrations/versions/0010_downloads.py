"""Downloads from the Hugging Face Hub (kept so that one under way goes on after a restart), and two
model config fields: how long a download before a start may take, and whether /v1 waits for it.

Revision ID: 0010_downloads
Revises: 0009_browser_sessions
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_downloads"
down_revision = "0009_browser_sessions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Mirrors manager.schemas.download.Download and the new ModelConfig fields.
    op.create_table(
        "download",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("repo", sa.String(), nullable=False),
        sa.Column("revision", sa.String(), nullable=False),
        sa.Column("commit", sa.String(), nullable=True),
        sa.Column("cache_dir", sa.String(), nullable=False),
        sa.Column("files", sa.JSON(), nullable=False),
        sa.Column("total_bytes", sa.Integer(), nullable=False),
        sa.Column("done_bytes", sa.Integer(), nullable=False),
        sa.Column(
            "state", sa.Enum("QUEUED", "RUNNING", "DONE", "FAILED", "CANCELLED", name="downloadstate"), nullable=False
        ),
        sa.Column("error", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_download_repo", "download", ["repo"])
    # ALTER TABLE ADD COLUMN, not a batch copy: copying model_config would cascade-delete its routing names.
    op.add_column("model_config", sa.Column("download_timeout_s", sa.Integer(), nullable=True))
    op.add_column(
        "model_config", sa.Column("wait_for_download", sa.Boolean(), nullable=False, server_default=sa.false())
    )


def downgrade() -> None:
    op.drop_column("model_config", "wait_for_download")
    op.drop_column("model_config", "download_timeout_s")
    op.drop_index("ix_download_repo", table_name="download")
    op.drop_table("download")
