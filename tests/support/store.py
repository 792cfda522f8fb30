"""The store from a test: a migrated one, and reading it."""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from reflow.store.database import migrate, open_engine
from reflow.store.tables import Base


def migrated_store(url: str) -> Iterator[Engine]:
    """A fixture's body: the store at `url`, migrated, disposed of afterwards."""
    engine = open_engine(url)
    migrate(engine)
    yield engine
    engine.dispose()


def count(engine: Engine, table: type[Base]) -> int:
    """Rows of `table`."""
    with Session(engine) as session:
        return session.scalar(select(func.count()).select_from(table)) or 0
