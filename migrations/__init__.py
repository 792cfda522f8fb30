"""Alembic migrations of the reflow store (run with `reflow db upgrade`)."""
