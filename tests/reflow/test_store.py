"""The store's migrations, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import column, insert, inspect, select, table, text

from reflow.store.database import downgrade, migrate, open_db, require_current_schema, schema_is_current
from reflow.store.tables import Base, Inference, utcnow


def test_migrations_upgrade_and_downgrade(database_url: str) -> None:
    db = open_db(database_url)
    assert not schema_is_current(db)
    with pytest.raises(RuntimeError, match="reflow db upgrade"):
        require_current_schema(db)
    migrate(db)
    assert schema_is_current(db)
    columns = {c["name"] for c in inspect(db).get_columns("tenants")}
    assert {"name", "key_hash", "key_prefix", "revoked_at"} <= columns
    assert "api_key" not in columns  # only the hash is stored
    migrate(db)  # idempotent
    downgrade(db, "0001")
    assert {"inferences", "feedback", "secrets", "finetune_runs"}.isdisjoint(inspect(db).get_table_names())
    assert "tenants" in inspect(db).get_table_names()
    migrate(db)
    downgrade(db, "base")
    assert "tenants" not in inspect(db).get_table_names()
    db.dispose()


def test_migrations_match_the_models(database_url: str) -> None:
    """The migrated schema is exactly what the SQLAlchemy models declare."""
    db = open_db(database_url)
    migrate(db)
    with db.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    db.dispose()
    assert differences == []


def test_inferences_stored_before_chat_have_an_empty_conversation(database_url: str) -> None:
    db = open_db(database_url)
    migrate(db, "0005")
    old = {
        "request_id": "r1", "tenant": "acme", "user_id": "", "model": "arith", "version": "1", "arm": "",
        "prompt": "1+1=", "reasoning": "", "completion": "2", "finish_reason": "STOP", "prompt_tokens": 5,
        "completion_tokens": 2, "reasoning_tokens": 0, "first_token_ms": 1.0, "total_ms": 2.0,
        "created_at": utcnow(), "stored_at": utcnow(),
    }  # fmt: skip
    with db.begin() as connection:
        connection.execute(insert(table("inferences", *map(column, old))).values(old))
    migrate(db)
    with db.connect() as connection:
        assert connection.scalar(select(Inference.messages)) == []
    db.dispose()


def test_tenants_own_experiments_end_when_the_store_goes_back_before_them(database_url: str) -> None:
    """Downgrading past 0010 with a shared and a tenant's experiment running on one model, and a
    decision recorded (its foreign key points at `experiments`): the tenant's experiment ends, the
    shared one runs on."""
    db = open_db(database_url)
    migrate(db)
    with db.begin() as connection:
        for tenant in ("", "acme"):
            connection.execute(
                text(
                    "INSERT INTO experiments (model, tenant, champion_version, challenger_version, traffic, "
                    "status, reason, started_at) VALUES ('m', :tenant, '1', '2', 0.5, 'running', '', :now)"
                ),
                {"tenant": tenant, "now": utcnow()},
            )
        connection.execute(
            text(
                "INSERT INTO experiment_decisions (experiment_id, outcome, reason, champion, challenger, "
                "likelihood_ratio, difference, srm_p, decided_at) "
                "VALUES (1, 'continue', '', '{}', '{}', 1, 0, 1, :now)"
            ),
            {"now": utcnow()},
        )
    downgrade(db, "0009")
    with db.connect() as connection:
        statuses = connection.execute(text("SELECT id, status FROM experiments ORDER BY id")).all()
    assert [tuple(row) for row in statuses] == [(1, "running"), (2, "ended")]
    assert "tenant" not in {c["name"] for c in inspect(db).get_columns("experiments")}
    migrate(db)
    assert schema_is_current(db)
