"""The store from a test: a new PostgreSQL database, a migrated store, and reading it."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from reflow.store.database import migrate, open_db
from reflow.store.tables import Base

POSTGRES_ADMIN_URL = os.environ.get(
    "REFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """The URL of a new, empty database on the machine's PostgreSQL, dropped afterwards; the test
    is skipped, saying why, where PostgreSQL cannot be reached."""
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"reflow_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as error:
        pytest.skip(f"PostgreSQL unreachable at {POSTGRES_ADMIN_URL} (set REFLOW_TEST_POSTGRES_URL): {error}")
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


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
