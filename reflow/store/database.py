"""Engines on the store's URL and the Alembic migrations that bring it to the current schema."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event

from reflow.private_files import private_file
from reflow.store.urls import store_url

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def open_db(url: str) -> Engine:
    """The database at `url` (normalised or refused by `store_url`) as a SQLAlchemy engine; SQLite
    gets WAL, a busy timeout, and its file 0600 in a directory created 0700."""
    parsed = store_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        private_file(Path(parsed.database))  # it holds the deployment's secrets and key hashes
    # hide_parameters: an error message never carries prompts, completions or corrections into logs
    db = create_engine(parsed, pool_pre_ping=True, hide_parameters=True)
    if db.dialect.name == "sqlite":

        @event.listens_for(db, "connect")
        def _sqlite_pragmas(dbapi_connection: sqlite3.Connection, _record: object) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=10000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    return db


def alembic_config(db: Engine) -> Config:
    """Alembic configuration for the migrations shipped in `migrations/`, bound to `db`."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["db"] = db
    return config


def migrate(db: Engine, revision: str = "head") -> None:
    """Upgrades the schema to `revision`."""
    command.upgrade(alembic_config(db), revision)


def downgrade(db: Engine, revision: str) -> None:
    """Downgrades the schema to `revision` ("base" removes every table)."""
    command.downgrade(alembic_config(db), revision)


def schema_is_current(db: Engine) -> bool:
    """True when the database is at the newest migration."""
    head = ScriptDirectory.from_config(alembic_config(db)).get_current_head()
    with db.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision() == head


def require_current_schema(db: Engine) -> None:
    """Refuses to run against a database that `reflow db upgrade` has not brought up to date."""
    if not schema_is_current(db):
        raise RuntimeError(
            f"the store at {db.url.render_as_string(hide_password=True)} is not at the current "
            "schema; run `reflow db upgrade` (reflow up does it for you)"
        )
