"""Reading the store from a test."""

from __future__ import annotations

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from reflow.store.tables import Base


def count(engine: Engine, table: type[Base]) -> int:
    """Rows of `table`."""
    with Session(engine) as session:
        return session.scalar(select(func.count()).select_from(table)) or 0
