"""The store's URLs: PostgreSQL without a driver named runs on psycopg; other drivers and dialects are
refused in one line, by the settings and by the CLI, without the password."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import make_url, text

from reflow.settings import Settings
from reflow.store.database import open_db, schema_is_current
from reflow.store.urls import store_url
from tests.support.cli import reflow

REFUSED = {
    "mysql://u:secret@h/db": "names the dialect mysql",
    "postgresql+psycopg2://u:secret@h/db": "names the driver psycopg2",
    "postgresql+asyncpg://u:secret@h/db": "names the driver asyncpg",
    "garbage": "not a database URL",
    "postgresql://u:secret@h:port/db": "not a database URL",
}


@pytest.mark.parametrize(
    ("url", "normalised"),
    [
        ("postgresql://u:p%40ss@h:5432/db?sslmode=require", "postgresql+psycopg://u:p%40ss@h:5432/db?sslmode=require"),
        ("postgres://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
        ("sqlite:///data/reflow.db", "sqlite:///data/reflow.db"),
    ],
)  # fmt: skip
def test_urls_name_the_driver_reflow_installs(url: str, normalised: str) -> None:
    assert store_url(url).render_as_string(hide_password=False) == normalised
    assert Settings(database_url=url).database_url == normalised


@pytest.mark.parametrize(("url", "problem"), REFUSED.items())
def test_other_drivers_and_dialects_are_refused(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as refused:
        open_db(url)
    assert "secret" not in str(refused.value) and "postgresql+psycopg://" in str(refused.value)
    with pytest.raises(ValidationError, match=problem):
        Settings(database_url=url)


@pytest.mark.parametrize("url", ["mysql://u:secret@h/db", "postgresql+psycopg2://u:secret@h/db"])
@pytest.mark.parametrize("command", [("db", "upgrade"), ("tenants", "list")])
def test_the_cli_refuses_them_in_one_line(url: str, command: tuple[str, ...], tmp_path: Path) -> None:
    result = reflow(*command, env={"REFLOW_DATA_DIR": str(tmp_path), "REFLOW_DATABASE_URL": url})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert "secret" not in result.stderr
    assert result.stderr.startswith("bad settings: REFLOW_DATABASE_URL: ")
    assert REFUSED[url] in result.stderr and "sqlite:///PATH" in result.stderr


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("dialect", ["postgresql", "postgres"])
def test_postgresql_without_a_driver_runs_on_psycopg(database_url: str, dialect: str, tmp_path: Path) -> None:
    url = make_url(database_url).set(drivername=dialect).render_as_string(hide_password=False)
    result = reflow("db", "upgrade", env={"REFLOW_DATA_DIR": str(tmp_path), "REFLOW_DATABASE_URL": url})
    assert result.returncode == 0, result.stderr
    db = open_db(url)
    try:
        assert db.dialect.driver == "psycopg" and schema_is_current(db)
        with db.connect() as connection:
            assert connection.execute(text("SELECT count(*) FROM tenants")).scalar_one() == 0
    finally:
        db.dispose()
