"""Feedback beyond thumbs: a preference of the rated completion over another of the same
conversation (`preferred_over`, its request_id), and 1-5 stars (the rating they count as is in
`rating`).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("feedback") as batch:  # items stored before said neither: "" / 0
        batch.add_column(sa.Column("preferred_over", sa.String(64), nullable=False, server_default=""))
        batch.add_column(sa.Column("stars", sa.SmallInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("feedback") as batch:
        batch.drop_column("stars")
        batch.drop_column("preferred_over")
