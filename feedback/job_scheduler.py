"""`reflow scheduler`: APScheduler 3 keeping its jobs in the store, running the fine-tune job and
the experiments' evaluate job.

Jobs live in the store's `scheduler_jobs` table, so their schedule survives restarts; coalesce
folds missed runs into one, max_instances=1 keeps a job from overlapping itself, and a run that
is late by up to one interval still runs. The job functions are module-level because the job
store keeps them by reference.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC
from typing import TYPE_CHECKING, Any

from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from reflow.settings import Settings
from reflow.store.leases import StoreLease

if TYPE_CHECKING:  # slow imports: loaded by the jobs themselves
    from feedback.experiments.job import EvaluateJob
    from feedback.training.job import FinetuneJob
    from reflow.registry import Registry

logger = logging.getLogger(__name__)
FINETUNE_JOB = "finetune"
EVALUATE_JOB = "evaluate"
JOBS_TABLE = "scheduler_jobs"
SCHEDULER_LEASE = "scheduler"  # the store's lease (reflow/store/leases.py) the running scheduler holds
STOPPING = threading.Event()  # set when the scheduler stops: a running fine-tune gives up


def finetune_job() -> None:
    """The scheduled fine-tune of each learning scope (reflow/scopes.py), one after the
    other: each runs only when enough new labelled feedback of its own has arrived; stops between
    two training steps when the scheduler is stopping."""
    from feedback.training.job import Cancelled, run_finetune
    from reflow.scopes import learning_scopes

    def stop_when_stopping(_step: int, _total: int, _loss: float) -> None:
        if STOPPING.is_set():
            raise Cancelled("the scheduler is stopping")

    def run(settings: Settings, db: Engine, registry: Registry) -> None:
        job = finetune_job_of(settings)
        for scope in learning_scopes(db):  # the shared model, then each tenant training its own
            if STOPPING.is_set():
                return
            outcome = run_finetune(job, db, registry, scope=scope, progress=stop_when_stopping)
            logger.info("fine-tune job for %s: %s (%s)", scope, outcome.status, outcome.message)

    _with_store(run)


def evaluate_job() -> None:
    """The scheduled evaluation of running experiments (and opening one for a new challenger)."""
    from feedback.experiments.job import evaluate_experiments

    def run(settings: Settings, db: Engine, registry: Registry) -> None:
        evaluate_experiments(evaluate_job_of(settings), db, registry)

    _with_store(run)


def _with_store(job: Callable[[Settings, Engine, Registry], None]) -> None:
    """Runs `job` with fresh settings, the store (`db`) and the registry, then closes the store."""
    from reflow.registry import Registry
    from reflow.store.database import open_db

    settings = Settings()
    db = open_db(settings.resolved_database_url)
    try:
        job(settings, db, Registry.from_settings(settings))
    finally:
        db.dispose()


def finetune_job_of(settings: Settings) -> FinetuneJob:
    """The fine-tune job REFLOW_MODEL_NAME, REFLOW_FINETUNE_* and REFLOW_AB_TRAFFIC describe."""
    from feedback.training.gate import Limits
    from feedback.training.general_prompts import DEFAULT_GENERAL_PROMPTS, GeneralPrompts
    from feedback.training.job import FinetuneJob
    from feedback.training.trainer import LORA_RECIPE, FinetuneConfig
    from reflow.worker_calls import WorkerTargets
    from workers.models.lora import LoraConfig

    chosen = {"steps": settings.finetune_steps, "batch_size": settings.finetune_batch_size,
              "lr": settings.finetune_lr}  # fmt: skip
    overrides: dict[str, Any] = {key: value for key, value in chosen.items() if value is not None}
    adapter = LoraConfig(settings.lora_rank, settings.lora_alpha, tuple(settings.lora_targets))
    limits = Limits(
        accuracy_drop=settings.finetune_regression_tolerance, kl=settings.finetune_max_regression_kl,
        nll_increase=settings.finetune_max_regression_nll_increase,
        reward_margin=settings.finetune_reward_margin, min_held_out=settings.finetune_min_held_out,
    )  # fmt: skip
    return FinetuneJob(
        model=settings.model_name, champion_alias=settings.model_alias, task=settings.task,
        min_samples=settings.finetune_min_samples, max_samples=settings.finetune_max_samples,
        max_per_user=settings.finetune_max_per_user,
        holdout_fraction=settings.finetune_holdout_fraction, limits=limits,
        recipe=replace(FinetuneConfig(), **overrides),
        lora_recipe=replace(LORA_RECIPE, lora=adapter, **overrides), method=settings.finetune_method,
        device=settings.device, cache_dir=settings.model_cache_dir, traffic=settings.ab_traffic,
        workers=WorkerTargets.from_settings(settings), variants=tuple(settings.variants),
        general_prompts=(
            GeneralPrompts.from_file(settings.general_prompts_file) if settings.general_prompts_file
            else DEFAULT_GENERAL_PROMPTS
        ),
    )  # fmt: skip


def evaluate_job_of(settings: Settings) -> EvaluateJob:
    """The evaluation round REFLOW_MODEL_NAME and REFLOW_AB_* describe."""
    from feedback.experiments.decision import Rules
    from feedback.experiments.job import EvaluateJob
    from reflow.worker_calls import WorkerTargets

    rules = Rules(
        alpha=settings.ab_alpha, min_samples=settings.ab_min_samples, traffic=settings.ab_traffic,
        max_error_rate_increase=settings.ab_max_error_rate_increase,
        max_latency_ratio=settings.ab_max_latency_ratio, max_duration_s=settings.ab_max_duration_s,
        max_per_user=settings.ab_max_per_user,
    )  # fmt: skip
    return EvaluateJob(
        settings.model_name, rules, WorkerTargets.from_settings(settings), settings.model_cache_dir
    )


def new_scheduler(db: Engine) -> BackgroundScheduler:
    """A scheduler with its job store in the database `db`."""
    return BackgroundScheduler(
        jobstores={"default": SQLAlchemyJobStore(engine=db, tablename=JOBS_TABLE)},
        job_defaults={"coalesce": True, "max_instances": 1},
        timezone=UTC,
    )


def ensure_job(
    scheduler: BackgroundScheduler, job_id: str, func: Callable[[], None], name: str, interval_s: float
) -> None:
    """Adds job `job_id` when the store has none; keeps its next run time when it has one, unless
    the interval changed. A run late by up to one interval still runs."""
    trigger = IntervalTrigger(seconds=interval_s, timezone=UTC)
    grace_s = max(int(interval_s), 1)
    job = scheduler.get_job(job_id)
    if job is None:
        scheduler.add_job(func, trigger, id=job_id, name=name, misfire_grace_time=grace_s)
    elif job.trigger.interval != trigger.interval:
        scheduler.reschedule_job(job_id, trigger=trigger)
        scheduler.modify_job(job_id, misfire_grace_time=grace_s)


def ensure_finetune_job(scheduler: BackgroundScheduler, interval_s: float) -> None:
    """The fine-tune job, every `interval_s`."""
    ensure_job(scheduler, FINETUNE_JOB, finetune_job, "fine-tune from new feedback", interval_s)


def ensure_evaluate_job(scheduler: BackgroundScheduler, interval_s: float) -> None:
    """The experiments' evaluate job, every `interval_s`."""
    ensure_job(scheduler, EVALUATE_JOB, evaluate_job, "evaluate running experiments", interval_s)


def run_scheduler(settings: Settings, db: Engine, stop: threading.Event, holder: str | None = None) -> None:
    """Runs the scheduled jobs while it holds the scheduler's lease, until `stop` is set, then waits
    for a running job to finish (a fine-tune run stops at its next step and gives its items back)
    and gives the lease up. While another scheduler holds the lease it stands by; it stops its jobs
    when it loses the lease, and stands by again."""
    lease = StoreLease(db, SCHEDULER_LEASE, holder or _holder_name(), settings.scheduler_lease_s)
    renew_s = settings.scheduler_lease_s / 3
    try:
        while not stop.is_set():
            if not _took(lease):
                logger.info("scheduler standing by: another scheduler holds the lease")
                while not stop.wait(renew_s) and not _took(lease):
                    pass
            if not stop.is_set():
                _run_jobs(settings, db, stop, lease, renew_s)
    finally:
        with contextlib.suppress(SQLAlchemyError):  # else it runs out
            lease.release()


def _run_jobs(
    settings: Settings, db: Engine, stop: threading.Event, lease: StoreLease, renew_s: float
) -> None:
    """The jobs, until `stop` is set or the lease is lost (not renewed before it expired)."""
    STOPPING.clear()
    scheduler = new_scheduler(db)
    scheduler.start(paused=True)
    ensure_finetune_job(scheduler, settings.finetune_interval_s)
    ensure_evaluate_job(scheduler, settings.ab_evaluate_s)
    scheduler.resume()
    job = scheduler.get_job(FINETUNE_JOB)
    logger.info(
        "scheduler running as %s: fine-tune every %.0fs when %d new labelled items arrived (next at %s); "
        "experiments evaluated every %.0fs",
        lease.holder, settings.finetune_interval_s, settings.finetune_min_samples,
        job.next_run_time if job else "-", settings.ab_evaluate_s,
    )  # fmt: skip
    held_until = time.monotonic() + settings.scheduler_lease_s
    while not stop.wait(renew_s):
        try:
            if not lease.take():
                logger.error("another scheduler took the lease: stopping the jobs")
                break
            held_until = time.monotonic() + settings.scheduler_lease_s
        except SQLAlchemyError as error:  # the lease holds until it would expire
            if time.monotonic() >= held_until:
                logger.error("the scheduler lease ran out with the store away (%s): stopping the jobs", error)
                break
            logger.warning("could not renew the scheduler lease: %s", error)
    STOPPING.set()
    scheduler.pause()  # no new submissions while the executor shuts down (APScheduler logged a
    scheduler.shutdown(wait=True)  # "cannot schedule new futures after shutdown" traceback there)


def _took(lease: StoreLease) -> bool:
    """lease.take(), False while the store cannot be reached."""
    try:
        return lease.take()
    except SQLAlchemyError as error:
        logger.warning("could not reach the store for the scheduler lease: %s", error)
        return False


def _holder_name() -> str:
    """This process as the lease's holder: its host, its pid and a nonce (a pid comes again)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
