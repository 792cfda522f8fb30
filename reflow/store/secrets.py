"""Server-side secrets every process of a deployment shares, kept in the store's `secrets` table
and created on first use (e.g. the key request ids are signed with, the key experiment arms are
drawn with)."""

from __future__ import annotations

import secrets

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from reflow.store.tables import Secret


def shared_secret(db: Engine, name: str) -> bytes:
    """The 32-byte secret `name`, created at random the first time any process asks (of two
    processes racing, the first insert wins and both return it)."""
    with Session(db) as session:
        secret = session.get(Secret, name)
        if secret is None:
            session.add(Secret(name=name, value=secrets.token_hex(32)))
            try:
                session.commit()
            except IntegrityError:  # another process created it first
                session.rollback()
            secret = session.scalars(select(Secret).where(Secret.name == name)).one()
        return bytes.fromhex(secret.value)
