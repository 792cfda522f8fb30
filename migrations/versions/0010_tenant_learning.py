"""What each tenant's feedback trains (`tenants.trains`), and the tenant whose own versions a
fine-tune run trained and an experiment tests (`tenant` of both; "" = the shared model's): one
running experiment per model and tenant.

Tenants stored before train the shared model, as every tenant's feedback did until now; `reflow
tenants update NAME --trains own` (or `nothing`) moves one off it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

RUNNING = sa.text("status = 'running'")


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("trains", sa.String(8), nullable=False, server_default="shared"))
    op.drop_index("ix_experiments_one_running", "experiments")
    for table in ("experiments", "finetune_runs"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("tenant", sa.String(128), nullable=False, server_default=""))
    op.create_index(
        "ix_experiments_one_running", "experiments", ["model", "tenant"], unique=True,
        sqlite_where=RUNNING, postgresql_where=RUNNING,
    )  # fmt: skip


def downgrade() -> None:
    # one running experiment per model again: tenants' own ones end; the columns go in place (a
    # batch copy of `experiments` would trip the foreign key of its decisions)
    op.execute("UPDATE experiments SET status = 'ended' WHERE tenant <> '' AND status = 'running'")
    op.drop_index("ix_experiments_one_running", "experiments")
    for table in ("finetune_runs", "experiments"):
        op.execute(f"ALTER TABLE {table} DROP COLUMN tenant")
    op.create_index(
        "ix_experiments_one_running", "experiments", ["model"], unique=True,
        sqlite_where=RUNNING, postgresql_where=RUNNING,
    )  # fmt: skip
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("trains")
