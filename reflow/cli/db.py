"""`reflow db`: the store's schema."""

from __future__ import annotations

from typing import Annotated

import typer

from reflow.cli.common import store_db

app = typer.Typer(help="Manage the store's schema.", no_args_is_help=True)


@app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Bring the store's schema up to REVISION (default: the newest)."""
    from reflow.store.database import migrate  # alembic: 120 ms off `reflow --help`

    migrate(store_db(), revision)


@app.command("downgrade")
def db_downgrade(revision: str) -> None:
    """Take the store's schema back to REVISION ("base" drops every table)."""
    from reflow.store.database import downgrade  # alembic: 120 ms off `reflow --help`

    downgrade(store_db(), revision)
