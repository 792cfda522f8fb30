"""The conversation of each chat completion, stored with its inference.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("inferences") as batch:  # rows stored before it were prompts: []
        batch.add_column(sa.Column("messages", sa.JSON(), nullable=False, server_default=sa.text("'[]'")))


def downgrade() -> None:
    with op.batch_alter_table("inferences") as batch:
        batch.drop_column("messages")
