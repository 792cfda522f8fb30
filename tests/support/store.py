"""The store from a test: a migrated one, and reading it."""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from reflow.store.database import migrate, open_db
from reflow.store.tables import Base


def migrated_store(url: str) -> Iterator[Engine]:
    """A fixture's body: the store at `url`, migrated, disposed of afterwards."""
    db = open_db(url)
    migrate(db)
    yield db
    db.dispose()


def count(db: Engine, table: type[Base]) -> int:
    """Rows of `table`."""
    with Session(db) as session:
        return session.scalar(select(func.count()).select_from(table)) or 0
