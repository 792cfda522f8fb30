"""Leases in the store: a named right that one process at a time holds, by renewing it before it
expires, and that another takes once it has expired (its holder died, or lost the store). The
scheduler holds one, so a second `reflow scheduler` (started by mistake, or as a standby) runs no
job until the first is gone.

Expiry is read from each holder's clock: hosts that share a lease keep their clocks within a small
part of its length of each other (NTP does), or a lease could be taken from a live holder early.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from reflow.store.tables import Lease, aware, utcnow


class StoreLease:
    """Lease `name` as `holder` sees it, `ttl_s` long from each renewal."""

    def __init__(
        self, db: Engine, name: str, holder: str, ttl_s: float, clock: Callable[[], datetime] = utcnow
    ):
        self.db = db
        self.name = name
        self.holder = holder
        self.ttl = timedelta(seconds=ttl_s)
        self.clock = clock

    def take(self) -> bool:
        """Takes the lease, or renews it when this holder has it; False while another holds it."""
        now = self.clock()
        with Session(self.db) as session, session.begin():
            taken = update(Lease).where(
                Lease.name == self.name, or_(Lease.holder == self.holder, Lease.expires_at <= now)
            )
            result = session.execute(taken.values(holder=self.holder, expires_at=now + self.ttl))
            if cast(CursorResult[Any], result).rowcount == 1:
                return True
            if session.get(Lease, self.name) is not None:
                return False
        try:  # never taken: the first to insert it holds it
            with Session(self.db) as session, session.begin():
                session.add(Lease(name=self.name, holder=self.holder, expires_at=now + self.ttl))
        except IntegrityError:
            return False
        return True

    def holder_now(self) -> str | None:
        """Who holds the lease now; None when nobody does."""
        with Session(self.db) as session:
            lease = session.scalar(select(Lease).where(Lease.name == self.name))
        if lease is None or aware(lease.expires_at) <= self.clock():
            return None
        return lease.holder

    def release(self) -> None:
        """Gives the lease up at once, if this holder has it, so another need not wait for it to expire."""
        with Session(self.db) as session, session.begin():
            mine = update(Lease).where(Lease.name == self.name, Lease.holder == self.holder)
            session.execute(mine.values(expires_at=self.clock()))
