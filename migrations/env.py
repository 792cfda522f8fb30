"""Alembic environment: runs migrations on the database (`db`) that reflow.store.database hands over."""

from __future__ import annotations

from alembic import context

from reflow.store.tables import Base

db = context.config.attributes["db"]
with db.begin() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    context.run_migrations()
