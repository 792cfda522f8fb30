"""A/B experiments, their decisions, and the experiment each inference belongs to.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

RUNNING = sa.text("status = 'running'")


def upgrade() -> None:
    op.create_table(
        "experiments",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("champion_version", sa.String(32), nullable=False),
        sa.Column("challenger_version", sa.String(32), nullable=False),
        sa.Column("traffic", sa.Float(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index(
        "ix_experiments_one_running", "experiments", ["model"], unique=True,
        sqlite_where=RUNNING, postgresql_where=RUNNING,
    )  # fmt: skip
    op.create_table(
        "experiment_decisions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("experiment_id", sa.Integer(), sa.ForeignKey("experiments.id"), nullable=False, index=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("champion", sa.JSON(), nullable=False),
        sa.Column("challenger", sa.JSON(), nullable=False),
        sa.Column("likelihood_ratio", sa.Float(), nullable=False),
        sa.Column("difference", sa.Float(), nullable=False),
        sa.Column("srm_p", sa.Float(), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("inferences") as batch:
        batch.add_column(sa.Column("experiment_id", sa.Integer(), nullable=True))
        batch.create_index("ix_inferences_experiment_id", ["experiment_id"])


def downgrade() -> None:
    with op.batch_alter_table("inferences") as batch:
        batch.drop_index("ix_inferences_experiment_id")
        batch.drop_column("experiment_id")
    op.drop_table("experiment_decisions")
    op.drop_index("ix_experiments_one_running", "experiments")
    op.drop_table("experiments")
