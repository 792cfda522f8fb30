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


def open_engine(url: str) -> Engine:
    """An engine for `url` (normalised or refused by `store_url`); SQLite gets WAL, a busy timeout, and
    its file 0600 in a directory created 0700."""
    parsed = store_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        private_file(Path(parsed.database))  # it holds the deployment's secrets and key hashes
    # hide_parameters: an error message never carries prompts, completions or corrections into logs
    engine = create_engine(parsed, pool_pre_ping=True, hide_parameters=True)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: sqlite3.Connection, _record: object) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=10000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    return engine


def alembic_config(engine: Engine) -> Config:
    """Alembic configuration for the migrations shipped in `migrations/`, bound to `engine`."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["engine"] = engine
    return config


def migrate(engine: Engine, revision: str = "head") -> None:
    """Upgrades the schema to `revision`."""
    command.upgrade(alembic_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Downgrades the schema to `revision` ("base" removes every table)."""
    command.downgrade(alembic_config(engine), revision)


def schema_is_current(engine: Engine) -> bool:
    """True when the database is at the newest migration."""
    head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision() == head


def require_current_schema(engine: Engine) -> None:
    """Refuses to run against a database that `reflow db upgrade` has not brought up to date."""
    if not schema_is_current(engine):
        raise RuntimeError(
            f"the store at {engine.url.render_as_string(hide_password=True)} is not at the current "
            "schema; run `reflow db upgrade` (reflow up does it for you)"
        )
