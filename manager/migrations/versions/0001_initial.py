"""Initial schema: offload profiles, model configs, API tokens, workers, events.

Revision ID: 0001_initial
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def _stamps() -> list[sa.Column]:
    return [
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "offload_profile",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False, unique=True, index=True),
        sa.Column("kv_offload_gib", sa.Float()),
        sa.Column("kv_offload_num_cpu_blocks", sa.Integer()),
        sa.Column("kv_eviction_policy", sa.String(), nullable=False),
        sa.Column("lora_cpu_pooling", sa.Boolean(), nullable=False),
        sa.Column("lora_pool_gib", sa.Float()),
        sa.Column("moe_expert_offload", sa.Boolean(), nullable=False),
        sa.Column("moe_gpu_cache_gib", sa.Float()),
        sa.Column("pinned_budget_gib", sa.Float()),
        sa.Column("description", sa.String(), nullable=False),
        *_stamps(),
    )
    op.create_table(
        "model_config",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False, unique=True, index=True),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("served_model_name", sa.String()),
        sa.Column("dtype", sa.String(), nullable=False),
        sa.Column("quantization", sa.String()),
        sa.Column("tensor_parallel_size", sa.Integer(), nullable=False),
        sa.Column("gpu_ids", sa.JSON(), nullable=False),
        sa.Column("gpu_memory_utilization", sa.Float(), nullable=False),
        sa.Column("max_model_len", sa.Integer()),
        sa.Column("max_num_seqs", sa.Integer()),
        sa.Column("kv_cache_dtype", sa.String(), nullable=False),
        sa.Column("enforce_eager", sa.Boolean(), nullable=False),
        sa.Column("enable_prefix_caching", sa.Boolean()),
        sa.Column("enable_lora", sa.Boolean(), nullable=False),
        sa.Column("max_loras", sa.Integer()),
        sa.Column("max_lora_rank", sa.Integer()),
        sa.Column("max_cpu_loras", sa.Integer()),
        sa.Column("extra_args", sa.JSON(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("autostart", sa.Boolean(), nullable=False),
        sa.Column("start_timeout_s", sa.Integer(), nullable=False),
        sa.Column("port", sa.Integer()),
        sa.Column(
            "offload_profile_id",
            sa.Integer(),
            sa.ForeignKey("offload_profile.id", ondelete="RESTRICT"),
        ),
        *_stamps(),
    )
    op.create_table(
        "api_token",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("sha256", sa.String(), nullable=False, unique=True, index=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "worker",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("model_name", sa.String(), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("port", sa.Integer()),
        sa.Column("desired", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("pid", sa.Integer()),
        sa.Column("pid_create_time", sa.Float()),
        sa.Column("cmdline", sa.JSON(), nullable=False),
        sa.Column("restart_count", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.String()),
        sa.Column("started_at", sa.DateTime()),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "event",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("ts", sa.DateTime(), nullable=False, index=True),
        sa.Column("worker_id", sa.Integer(), index=True),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("message", sa.String(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
    )


def downgrade() -> None:
    for table in ("event", "worker", "api_token", "model_config", "offload_profile"):
        op.drop_table(table)
