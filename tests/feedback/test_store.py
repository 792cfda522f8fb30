"""The store's migrations, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from feedback.store import downgrade, migrate, open_engine, require_current_schema, schema_is_current


def test_migrations_upgrade_and_downgrade(database_url: str) -> None:
    engine = open_engine(database_url)
    assert not schema_is_current(engine)
    with pytest.raises(RuntimeError, match="reflow db upgrade"):
        require_current_schema(engine)
    migrate(engine)
    assert schema_is_current(engine)
    columns = {c["name"] for c in inspect(engine).get_columns("tenants")}
    assert {"name", "key_hash", "key_prefix", "revoked_at"} <= columns
    assert "api_key" not in columns  # only the hash is stored
    migrate(engine)  # idempotent
    downgrade(engine, "base")
    assert "tenants" not in inspect(engine).get_table_names()
    engine.dispose()
