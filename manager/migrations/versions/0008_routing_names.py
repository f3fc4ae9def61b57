"""Routing names: every name /v1 requests route by, unique in the store, held by one config or adapter.

Filled from the stored configs and adapters. A database written before the store enforced this may
hold a name twice (two clients that created configs at the same moment); then, so that no config is
lost and every name leads to one model:

- a config's own name always stays its own;
- a served model name or alias stays with the config created first; the later config loses it (the
  alias is taken out of its aliases; the served model name is cleared, and its engine serves the
  model under the config's name);
- a LoRA adapter whose name a config answers to stays registered, but routes nowhere.

Each of these is logged and recorded as a ``names_dropped`` event (GET /api/events).

Revision ID: 0008_routing_names
Revises: 0007_nodes
"""

import logging
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0008_routing_names"
down_revision = "0007_nodes"
branch_labels = None
depends_on = None

log = logging.getLogger("vllm_manager.store")

_configs = sa.table(
    "model_config",
    sa.column("id", sa.Integer),
    sa.column("name", sa.String),
    sa.column("served_model_name", sa.String),
    sa.column("aliases", sa.JSON),
)
_adapters = sa.table(
    "lora_adapter", sa.column("id", sa.Integer), sa.column("name", sa.String), sa.column("base_config", sa.String)
)
_events = sa.table(
    "event",
    sa.column("ts", sa.DateTime),
    sa.column("worker_id", sa.Integer),
    sa.column("kind", sa.String),
    sa.column("message", sa.String),
    sa.column("data", sa.JSON),
)


def upgrade() -> None:
    # Mirrors manager.schemas.routing_name.RoutingName.
    routing_name = op.create_table(
        "routing_name",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("model_config_id", sa.Integer(), sa.ForeignKey("model_config.id", ondelete="CASCADE"), nullable=True),
        sa.Column("lora_adapter_id", sa.Integer(), sa.ForeignKey("lora_adapter.id", ondelete="CASCADE"), nullable=True),
        sa.CheckConstraint("(model_config_id IS NULL) <> (lora_adapter_id IS NULL)", name="ck_routing_name_one_holder"),
    )
    op.create_index("ix_routing_name_name", "routing_name", ["name"], unique=True)
    op.create_index("ix_routing_name_model_config_id", "routing_name", ["model_config_id"])
    op.create_index("ix_routing_name_lora_adapter_id", "routing_name", ["lora_adapter_id"])
    rows, dropped = _names_held(op.get_bind())
    if rows:
        op.bulk_insert(routing_name, rows)
    if dropped:
        now = datetime.now(UTC)
        events: list[dict] = [
            {"ts": now, "worker_id": None, "kind": "names_dropped", "message": m, "data": {}} for m in dropped
        ]
        op.bulk_insert(_events, events)
    for message in dropped:
        log.warning("%s", message)


def _names_held(conn: sa.Connection) -> tuple[list[dict], list[str]]:
    """The routing name rows for the stored configs and adapters, and what was dropped to make each
    name lead to one model (said for the log). Later configs lose their duplicate names here."""
    configs = conn.execute(sa.select(_configs).order_by(_configs.c.id)).all()
    holder: dict[str, str] = {}
    rows: list[dict] = []
    dropped: list[str] = []

    def hold(name: str, kind: str, said: str, **owner: int) -> None:
        holder[name] = said
        rows.append({"name": name, "kind": kind, "model_config_id": None, "lora_adapter_id": None, **owner})

    for c in configs:  # names first: a config keeps its own name whatever else answers to it
        hold(c.name, "name", f"the name of model config {c.name!r}", model_config_id=c.id)
    for c in configs:  # then served names and aliases, the oldest config first
        served = c.served_model_name
        if served and served != c.name:
            if served in holder:
                dropped.append(
                    f"model config {c.name!r}: its served model name {served!r} was cleared, as {served!r} is "
                    f"{holder[served]}; its engine now serves it as {c.name!r}"
                )
                served = None
                conn.execute(sa.update(_configs).where(_configs.c.id == c.id).values(served_model_name=None))
            else:
                hold(
                    served,
                    "served model name",
                    f"the served model name of model config {c.name!r}",
                    model_config_id=c.id,
                )
        kept = []
        for alias in c.aliases or []:
            if alias in holder:
                dropped.append(
                    f"model config {c.name!r}: its alias {alias!r} was removed, as {alias!r} is {holder[alias]}"
                )
                continue
            hold(alias, "alias", f"the alias of model config {c.name!r}", model_config_id=c.id)
            kept.append(alias)
        if kept != list(c.aliases or []):
            conn.execute(sa.update(_configs).where(_configs.c.id == c.id).values(aliases=kept))
    for a in conn.execute(sa.select(_adapters).order_by(_adapters.c.id)).all():
        if a.name in holder:
            dropped.append(
                f"LoRA adapter {a.name!r} of {a.base_config!r} answers to no /v1 name, as {a.name!r} is "
                f"{holder[a.name]}: remove it and add it again under another name"
            )
            continue
        hold(a.name, "adapter", f"a LoRA adapter of model config {a.base_config!r}", lora_adapter_id=a.id)
    return rows, dropped


def downgrade() -> None:
    # Names dropped on the way up stay dropped.
    op.drop_index("ix_routing_name_lora_adapter_id", table_name="routing_name")
    op.drop_index("ix_routing_name_model_config_id", table_name="routing_name")
    op.drop_index("ix_routing_name_name", table_name="routing_name")
    op.drop_table("routing_name")
