"""Feedback ids unique per tenant, longer user ids, and the fine-tune run that used each item.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# SQLite's unique constraint from 0002 has no name: this convention names it for batch mode.
NAMING = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def _old_unique_name() -> str:
    return (
        "feedback_feedback_id_key"
        if op.get_bind().dialect.name == "postgresql"
        else "uq_feedback_feedback_id"
    )


def upgrade() -> None:
    with op.batch_alter_table("feedback", naming_convention=NAMING) as batch:
        batch.drop_constraint(_old_unique_name(), type_="unique")
        batch.create_unique_constraint("uq_feedback_tenant_feedback_id", ["tenant", "feedback_id"])
        batch.alter_column("user_id", type_=sa.String(256), existing_type=sa.String(128))
        batch.add_column(sa.Column("finetune_run_id", sa.Integer(), nullable=True))
        batch.create_index("ix_feedback_finetune_run_id", ["finetune_run_id"])
    with op.batch_alter_table("inferences") as batch:
        batch.alter_column("user_id", type_=sa.String(256), existing_type=sa.String(128))


def downgrade() -> None:
    with op.batch_alter_table("inferences") as batch:
        batch.alter_column("user_id", type_=sa.String(128), existing_type=sa.String(256))
    with op.batch_alter_table("feedback", naming_convention=NAMING) as batch:
        batch.drop_index("ix_feedback_finetune_run_id")
        batch.drop_column("finetune_run_id")
        batch.alter_column("user_id", type_=sa.String(128), existing_type=sa.String(256))
        batch.drop_constraint("uq_feedback_tenant_feedback_id", type_="unique")
        batch.create_unique_constraint(_old_unique_name(), ["feedback_id"])
