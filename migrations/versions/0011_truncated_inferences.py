"""Inference events cut to fit a Kafka record (`REFLOW_MAX_EVENT_BYTES`) say so: their texts are
not what the user saw, so the fine-tune job leaves them out.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("inferences") as batch:  # rows stored before were whole
        batch.add_column(sa.Column("truncated", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("inferences") as batch:
        batch.drop_column("truncated")
