"""The store's URL: the one place a database URL is normalised to the driver reflow installs, or refused."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

_SUPPORTED = (
    "reflow's store runs on SQLite (sqlite:///PATH) or PostgreSQL through psycopg "
    "(postgresql://… or postgresql+psycopg://…)"
)
# The driver reflow installs for each dialect it runs on: the standard library's sqlite3, psycopg 3.
_DRIVERS = {"sqlite": "pysqlite", "postgresql": "psycopg"}


def store_url(url: str) -> URL:
    """`url` naming the driver reflow installs (`postgresql://` and `postgres://` mean psycopg); a
    ValueError, one line saying what is supported, for any other dialect or driver."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise ValueError(f"not a database URL (DIALECT://…); {_SUPPORTED}") from None
    shown = parsed.render_as_string(hide_password=True)
    dialect, _, driver = parsed.drivername.partition("+")
    if dialect == "postgres":  # Heroku's and libpq's spelling, which SQLAlchemy no longer reads
        dialect = "postgresql"
    if dialect not in _DRIVERS:
        raise ValueError(f"{shown} names the dialect {dialect}; {_SUPPORTED}")
    if driver not in ("", _DRIVERS[dialect]):
        raise ValueError(f"{shown} names the driver {driver}; {_SUPPORTED}")
    # SQLite's default driver is the one reflow uses; PostgreSQL's is psycopg2, which it does not install
    return parsed if dialect == "sqlite" else parsed.set(drivername=f"{dialect}+{_DRIVERS[dialect]}")
