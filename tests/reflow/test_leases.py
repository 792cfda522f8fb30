"""A lease in the store, on SQLite and PostgreSQL: one holder at a time, renewed by it, taken by
another once it expired or was given up, and lost by a holder that let it expire."""

from __future__ import annotations

from datetime import timedelta

from reflow.store.database import migrate, open_db
from reflow.store.leases import StoreLease
from reflow.store.tables import utcnow


def test_one_holder_at_a_time_until_it_expires_or_is_given_up(database_url: str) -> None:
    db = open_db(database_url)
    migrate(db)
    now = [utcnow()]

    def lease(holder: str) -> StoreLease:
        return StoreLease(db, "scheduler", holder, ttl_s=30, clock=lambda: now[0])

    first, second = lease("first"), lease("second")
    try:
        assert first.holder_now() is None
        assert first.take() and not second.take()  # never taken: the first to take it holds it
        assert second.holder_now() == "first"
        now[0] += timedelta(seconds=20)
        assert first.take() and not second.take()  # renewed: 30 s from now
        now[0] += timedelta(seconds=20)
        assert not second.take() and second.holder_now() == "first"
        now[0] += timedelta(seconds=11)  # not renewed in time: it expired
        assert first.holder_now() is None
        assert second.take() and not first.take()  # taken by the other; the first lost it
        second.release()
        assert first.holder_now() is None and first.take() and first.holder_now() == "first"
        second.release()  # not the holder's: changes nothing
        assert second.holder_now() == "first"
        assert StoreLease(db, "other", "second", 30, clock=lambda: now[0]).take()  # names apart
    finally:
        db.dispose()
