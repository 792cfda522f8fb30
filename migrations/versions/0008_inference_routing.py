"""How the gateway placed each inference for its deadline: the variant that served it, the
request's latency budget, the predicted total time and the reasoning budget applied.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

COLUMNS = ("variant", "latency_budget_ms", "predicted_total_ms", "reasoning_budget")


def upgrade() -> None:
    with op.batch_alter_table("inferences") as batch:  # rows stored before it said nothing: "" / 0
        batch.add_column(sa.Column("variant", sa.String(32), nullable=False, server_default=""))
        batch.add_column(sa.Column("latency_budget_ms", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("predicted_total_ms", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("reasoning_budget", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("inferences") as batch:
        for column in COLUMNS:
            batch.drop_column(column)
