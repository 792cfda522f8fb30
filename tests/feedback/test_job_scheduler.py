"""The scheduler: its jobs kept in the store across restarts, a job never overlapping itself, a
fine-tune run never overlapping another one started elsewhere, and one scheduler at a time."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from feedback.job_scheduler import (
    FINETUNE_JOB,
    SCHEDULER_LEASE,
    ensure_finetune_job,
    finetune_job,
    new_scheduler,
    run_scheduler,
)
from feedback.training.job import STALE_AFTER, claim_run
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from reflow.store.leases import StoreLease
from reflow.store.tables import FeedbackItem, FinetuneRun, utcnow
from tests.support.waiting import wait_for


def store(tmp_path: Path):
    db = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(db)
    return db


def test_the_finetune_job_and_its_next_run_survive_a_restart(tmp_path: Path) -> None:
    db = store(tmp_path)
    first = new_scheduler(db)
    first.start(paused=True)
    ensure_finetune_job(first, interval_s=3600)
    planned = first.get_job(FINETUNE_JOB).next_run_time
    first.shutdown()

    second = new_scheduler(db)
    second.start(paused=True)
    try:
        kept = second.get_job(FINETUNE_JOB)
        assert kept is not None and kept.func is finetune_job and kept.next_run_time == planned
        ensure_finetune_job(second, interval_s=3600)  # same interval: the schedule stands
        assert second.get_job(FINETUNE_JOB).next_run_time == planned
        ensure_finetune_job(second, interval_s=60)  # a new interval takes effect
        assert second.get_job(FINETUNE_JOB).trigger.interval == timedelta(seconds=60)
        assert len(second.get_jobs()) == 1
        job = second.get_job(FINETUNE_JOB)
        assert (job.coalesce, job.max_instances, job.misfire_grace_time) == (True, 1, 60)
    finally:
        second.shutdown()


RUNS = {"active": 0, "most_active": 0, "finished": 0}
LOCK = threading.Lock()


def slow_job() -> None:
    """A job that takes longer than its interval (referenced by the job store, so module-level)."""
    with LOCK:
        RUNS["active"] += 1
        RUNS["most_active"] = max(RUNS["most_active"], RUNS["active"])
    time.sleep(0.5)
    with LOCK:
        RUNS["active"] -= 1
        RUNS["finished"] += 1


def test_a_job_never_overlaps_itself(tmp_path: Path) -> None:
    scheduler = new_scheduler(store(tmp_path))
    scheduler.start()
    scheduler.add_job(slow_job, IntervalTrigger(seconds=0.1), id="slow")
    wait_for(lambda: RUNS["finished"] >= 3, what="three runs of a job due every 0.1 s that takes 0.5 s")
    scheduler.shutdown(wait=True)
    assert RUNS["most_active"] == 1


def test_a_second_finetune_run_waits_while_one_is_running(tmp_path: Path) -> None:
    db = store(tmp_path)
    with Session(db) as session, session.begin():
        session.add_all(
            FeedbackItem(feedback_id=f"f{i}", request_id=f"r{i}", tenant="acme", rating=1, correction="",
                         user_id="", labels={}, created_at=utcnow())
            for i in range(1, 4)
        )  # fmt: skip
    first = claim_run(db, "arith", "1", [1, 2])
    assert first is not None
    assert claim_run(db, "arith", "1", [3]) is None  # e.g. `reflow finetune run` meanwhile
    other = claim_run(db, "other-model", "1", [3])  # other models are independent
    assert other is not None
    assert claim_run(db, "third-model", "1", [3]) is None  # item 3 is taken already
    with db.begin() as connection:  # the first one's process was killed long ago
        connection.execute(
            update(FinetuneRun).where(FinetuneRun.id == first).values(started_at=utcnow() - 2 * STALE_AFTER)
        )
    again = claim_run(db, "arith", "1", [1, 2])  # its items were given back
    assert again is not None
    with Session(db) as session:
        assert session.get(FinetuneRun, first).status == "failed"
        marks = dict(session.execute(select(FeedbackItem.id, FeedbackItem.finetune_run_id)).all())
    assert marks == {1: again, 2: again, 3: other}


def test_a_second_scheduler_stands_by_until_the_first_is_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both on one store, as two `reflow scheduler` processes would be: only the lease's holder
    runs the jobs; the other takes over once the first stops (and gives the lease up)."""
    db = store(tmp_path)
    settings = Settings(data_dir=tmp_path, scheduler_lease_s=15, finetune_interval_s=3600, ab_evaluate_s=3600)
    lease = StoreLease(db, SCHEDULER_LEASE, "observer", ttl_s=1)
    stops = {name: threading.Event() for name in ("first", "second")}
    threads = {
        name: threading.Thread(
            target=run_scheduler, args=(settings, db, stop, name), name=f"scheduler-{name}"
        )
        for name, stop in stops.items()
    }
    caplog.set_level(logging.INFO, logger="feedback.job_scheduler")

    def said(text: str) -> bool:
        return any(text in record.getMessage() for record in caplog.records)

    try:
        threads["first"].start()
        wait_for(lambda: said("scheduler running as first"), what="the first scheduler to run its jobs")
        threads["second"].start()
        wait_for(lambda: said("standing by"), what="the second scheduler to stand by")
        assert lease.holder_now() == "first" and not said("running as second")
        stops["first"].set()
        threads["first"].join()
        wait_for(lambda: said("scheduler running as second"), what="the second to take over")
        assert lease.holder_now() == "second"
    finally:
        for stop in stops.values():
            stop.set()
        for thread in threads.values():
            if thread.is_alive():
                thread.join()
        db.dispose()
