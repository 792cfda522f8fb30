"""`reflow scheduler`: APScheduler 3 keeping its jobs in the store, running the fine-tune job.

Jobs live in the store's `scheduler_jobs` table, so their schedule survives restarts; coalesce
folds missed runs into one, max_instances=1 keeps a job from overlapping itself, and a run that
is late by up to one interval still runs. The job functions are module-level because the job
store keeps them by reference.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC

from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import Engine

from reflow.settings import Settings

logger = logging.getLogger(__name__)
FINETUNE_JOB = "finetune"
JOBS_TABLE = "scheduler_jobs"


def finetune_job() -> None:
    """The scheduled fine-tune: runs only when enough new labelled feedback has arrived."""
    from feedback.jobs import run_finetune
    from feedback.registry import Registry
    from feedback.store import open_engine

    settings = Settings()
    engine = open_engine(settings.resolved_database_url)
    try:
        outcome = run_finetune(
            settings, engine, Registry(settings.resolved_tracking_uri, settings.resolved_artifact_root)
        )
        logger.info("fine-tune job: %s (%s)", outcome.status, outcome.message)
    finally:
        engine.dispose()


def new_scheduler(engine: Engine, misfire_grace_s: float) -> BackgroundScheduler:
    """A scheduler with its job store in `engine`'s database."""
    return BackgroundScheduler(
        jobstores={"default": SQLAlchemyJobStore(engine=engine, tablename=JOBS_TABLE)},
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": int(misfire_grace_s)},
        timezone=UTC,
    )


def ensure_finetune_job(scheduler: BackgroundScheduler, interval_s: float) -> None:
    """Adds the fine-tune job when the store has none; keeps its next run time when it has one,
    unless the interval changed."""
    trigger = IntervalTrigger(seconds=interval_s, timezone=UTC)
    job = scheduler.get_job(FINETUNE_JOB)
    if job is None:
        scheduler.add_job(finetune_job, trigger, id=FINETUNE_JOB, name="fine-tune from new feedback")
    elif job.trigger.interval != trigger.interval:
        scheduler.reschedule_job(FINETUNE_JOB, trigger=trigger)


def run_scheduler(settings: Settings, engine: Engine, stop: threading.Event) -> None:
    """Runs the scheduled jobs until `stop` is set, then waits for a running job to finish."""
    scheduler = new_scheduler(engine, settings.finetune_interval_s)
    scheduler.start(paused=True)
    ensure_finetune_job(scheduler, settings.finetune_interval_s)
    scheduler.resume()
    job = scheduler.get_job(FINETUNE_JOB)
    logger.info(
        "scheduler running: fine-tune every %.0fs when %d new labelled items arrived; next at %s",
        settings.finetune_interval_s, settings.finetune_min_samples, job.next_run_time if job else "-",
    )  # fmt: skip
    stop.wait()
    scheduler.shutdown(wait=True)
