"""The fine-tune job: new labelled feedback → a candidate trained from the champion → the gate →
an MLflow run, and a new version with alias `challenger` when the candidate passed.

Every run that starts is recorded in `finetune_runs` and marks the feedback items it takes; a
registered or rejected run keeps them, a failed one gives them back to the next run.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from sqlalchemy import Engine, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from feedback.experiments.lifecycle import reconcile
from feedback.experiments.promotion import push_to_workers
from feedback.tasks import BUILTIN_MODEL_TASK, get_task
from feedback.tasks.task import Example, Task, replay_example
from feedback.training import gate
from feedback.training.dataset import RatedCompletion, build_dataset, count_new, load_new
from feedback.training.evaluation import task_score_tags
from feedback.training.general_prompts import DEFAULT_GENERAL_PROMPTS, GeneralPrompts
from feedback.training.trainer import FinetuneConfig, train_candidate
from reflow.registry import BASE_VERSION_TAG, TENANT_TAG, Registry, VersionRef
from reflow.scopes import SHARED, Scope, champion_of
from reflow.store.experiments import running_experiment
from reflow.store.tables import FeedbackItem, FinetuneRun, utcnow
from reflow.worker_calls import WorkerTargets
from workers.models.builtin import MODEL_TYPE as BUILTIN
from workers.models.interface import CausalLM, Tokenizer
from workers.models.loader import load_checkpoint, resolve_device, save_checkpoint
from workers.models.lora import Adapter

logger = logging.getLogger(__name__)
STALE_AFTER = timedelta(minutes=30)  # a `running` row older than this belongs to a killed job
METHODS = ("auto", "full", "lora")  # REFLOW_FINETUNE_METHOD
PROGRESS_LOGS = 10  # log lines over a run's steps


class Cancelled(Exception):
    """Raised by a progress callback to stop a run between steps (e.g. the scheduler stopping);
    the run is recorded as failed and its items go back to the next one."""


@dataclass(frozen=True)
class Outcome:
    """What a call of `run_finetune` did: skipped, registered, rejected (with why), or failed."""

    status: str
    message: str
    run: int | None = None  # finetune_runs.id
    version: str = ""
    metrics: dict[str, float] | None = None


@dataclass(frozen=True)
class FinetuneJob:
    """What a fine-tune run needs: whose champion, how much feedback, the recipe, the gate, where it
    runs, and what to tell once a challenger is registered."""

    model: str
    champion_alias: str
    task: str  # REFLOW_TASK: a demo task whose oracle is measured too; "" = none (production)
    min_samples: int  # new labelled items a scheduled run waits for
    max_samples: int  # most items one run takes
    max_per_user: int  # most items of one user one run takes
    holdout_fraction: float
    limits: gate.Limits
    recipe: FinetuneConfig  # a full fine-tune's; its seed is set per run
    lora_recipe: FinetuneConfig  # a LoRA fine-tune's
    method: str  # METHODS: auto trains adapters for Llama-family champions, the small built-in one in full
    device: str
    cache_dir: Path  # local copies of downloaded versions
    traffic: float  # the challenger's share in the experiment it opens
    workers: WorkerTargets  # told to load the challenger at once
    variants: tuple[str, ...] = ()  # REFLOW_VARIANTS: scored on a task when a full fine-tune registers
    general_prompts: GeneralPrompts = DEFAULT_GENERAL_PROMPTS  # replayed, and where drift is measured


def run_finetune(
    job: FinetuneJob,
    db: Engine,
    registry: Registry,
    *,
    model: str | None = None,
    scope: Scope = SHARED,
    min_samples: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> Outcome:
    """Fine-tunes the champion of `model` (the job's by default) in `scope` (the shared model, or a
    tenant's own versions) on the oldest labelled feedback of that scope no run has used yet (at
    most `job.max_samples` items, `job.max_per_user` of each user; the rest waits for the next
    run)."""
    name = model or job.model
    needed = job.min_samples if min_samples is None else min_samples
    if (experiment := running_experiment(db, name, scope.tenant)) is not None:
        return Outcome(
            "skipped",
            f"experiment {experiment.id} is still testing v{experiment.challenger_version} of {name} "
            f"for {scope}",
        )
    new = count_new(db, name, scope, job.max_per_user)
    if new < max(needed, 1):
        return Outcome(
            "skipped", f"{new} new labelled feedback item(s) on {name} for {scope}; waiting for {needed}"
        )
    if scope.tenant:
        parent = champion_of(registry, name, scope)
    else:
        parent = registry.resolve(name, alias=job.champion_alias)
        if registry.tags(parent).get(BASE_VERSION_TAG):  # promotion merges adapters: only by hand
            return Outcome(
                "skipped",
                f"{name} v{parent.version}, the champion, is an adapter (set by hand?); promote a full "
                "version (`reflow models promote` merges an adapter into one) before training over it",
            )
    items = load_new(db, name, job.max_samples, scope, job.max_per_user)
    run_id = claim_run(db, name, parent.version, [item.id for item in items], scope.tenant)
    if run_id is None:
        return Outcome("skipped", "another fine-tune run of this model is in progress")
    try:
        return _train_and_judge(
            job, db, registry, run_id=run_id, parent_ref=parent, items=items, scope=scope, progress=progress
        )
    except Exception as error:
        if isinstance(error, Cancelled):
            logger.info("fine-tune run %d cancelled: %s", run_id, error)
        else:
            logger.exception("fine-tune run %d failed", run_id)
        with Session(db) as session, session.begin():  # the next run tries these items again
            _mark_failed(session, run_id, f"{type(error).__name__}: {error}")
        return Outcome("failed", str(error), run_id)


def _train_and_judge(
    job: FinetuneJob,
    db: Engine,
    registry: Registry,
    *,
    run_id: int,
    parent_ref: VersionRef,
    items: list[RatedCompletion],
    scope: Scope,
    progress: Callable[[int, int, float], None] | None,
) -> Outcome:
    started = time.perf_counter()
    first_id, last_id = items[0].id, items[-1].id
    device = resolve_device(job.device)
    name, parent = parent_ref.name, parent_ref.version
    champion, tokenizer, base = load_version(registry, parent_ref, job.cache_dir, device)
    task = task_of(job, champion)
    dataset = build_dataset(items, job.holdout_fraction, task.thought if task else _no_thought)
    config = replace(recipe_for(job, champion), seed=run_id)
    replay = replay_source(task, champion, tokenizer, job.general_prompts.replay)
    logged = _logging_progress(run_id, progress)
    candidate, history = train_candidate(champion, tokenizer, dataset, replay, config, logged)
    train_s = time.perf_counter() - started
    logger.info("fine-tune run %d trained in %.1fs on %d items", run_id, train_s, dataset.size)
    before: dict[str, float] = {}
    after = gate.feedback_shift(champion, candidate, tokenizer, dataset.held_out)
    if task is not None:  # a demo task: its oracle's numbers beside the gate's
        before |= gate.oracle_metrics(champion, tokenizer, task, dataset.held_out_answers)
        after |= gate.oracle_metrics(candidate, tokenizer, task, dataset.held_out_answers)
    if task is None or not gate.has_base_answers(task):
        after |= gate.regression_shift(
            champion,
            candidate,
            tokenizer,
            gate.champion_answers(champion, tokenizer, job.general_prompts.regression),
        )
    logger.info("fine-tune run %d evaluated in %.1fs", run_id, time.perf_counter() - started - train_s)
    verdict = gate.judge(before, after, job.limits)
    metrics = {
        **{f"champion_{k}": v for k, v in before.items()},
        **{f"candidate_{k}": v for k, v in after.items()},
        "samples": float(dataset.size), "supervised_examples": float(len(dataset.supervised)),
        "rated_examples": float(dataset.rated), "preference_pairs": float(len(dataset.pairs)),
        "train_seconds": train_s,
        "trained_parameters": float(sum(p.numel() for p in candidate.parameters())),
    }  # fmt: skip
    # the adapter trained (a tenant's own champion's, trained further, keeps its own shape)
    lora = candidate.adapter.config if candidate.adapter is not None else None
    params = {
        **{k: v for k, v in asdict(config).items() if k != "lora"}, "parent_version": parent,
        "method": "lora" if lora else "full", "feedback_first_id": first_id, "feedback_last_id": last_id,
        "dataset_size": dataset.size, "dataset_sha256": dataset.digest,
        "holdout_fraction": job.holdout_fraction, "regression_tolerance": job.limits.accuracy_drop,
        "max_regression_kl": job.limits.kl, "max_regression_nll_increase": job.limits.nll_increase,
        "reward_margin": job.limits.reward_margin, "min_held_out": job.limits.min_held_out,
        "task": task.name if task else "none", "device": str(device), "tenant": scope.tenant or "(shared)",
        "max_per_user": job.max_per_user,
    }  # fmt: skip
    if lora:
        params |= {"lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_targets": ",".join(lora.targets)}
    fields = ("loss", "sft", "kto", "dpo", "kl", "kto_reference_point")
    curves = {f"train_{field}": [getattr(s, field) for s in history] for field in fields}
    tags = {"reflow.source": "finetune", "reflow.parent_version": parent, "reflow.verdict": verdict.reason}
    tags |= {TENANT_TAG: scope.tenant} if scope.tenant else {}
    with tempfile.TemporaryDirectory() as tmp:
        mlflow_run, source = registry.log_run(
            f"{name}-finetune-{run_id}", params=params, metrics=metrics,
            model_dir=save_checkpoint(candidate, tokenizer, Path(tmp)),
            history=curves, tags=tags,
        )  # fmt: skip
    version = ""
    if verdict.register:
        version_tags = {
            "reflow.parent_version": parent,
            "reflow.run_id": mlflow_run,
            "reflow.finetune_run": str(run_id),
        }
        if scope.tenant:  # served to this tenant alone
            version_tags[TENANT_TAG] = scope.tenant
        if lora:  # served over the weights it was trained on (an adapter's workers build no variants)
            version_tags[BASE_VERSION_TAG] = base
        elif job.variants and task is not None:
            version_tags |= task_score_tags(candidate, tokenizer, task, job.variants)
        version = registry.register_version(
            name, mlflow_run, source, alias=scope.challenger, tags=version_tags
        ).version
    status = "registered" if verdict.register else "rejected"
    _finish(
        db, run_id, status=status, message=verdict.reason, samples=dataset.size,
        dataset_hash=dataset.digest, mlflow_run_id=mlflow_run, version=version, metrics=metrics,
    )  # fmt: skip
    logger.info("fine-tune run %d %s: %s", run_id, status, verdict.reason)
    if verdict.register:  # the experiment opens now, and the workers load the challenger now
        try:
            reconcile(db, registry, name, job.traffic, scope)
            push_to_workers(job.workers)
        except Exception:  # the run stands; the evaluate job opens the experiment, workers poll
            logger.exception("fine-tune run %d: opening the experiment failed; the evaluate job will", run_id)
    return Outcome(status, verdict.reason, run_id, version, metrics)


def task_of(job: FinetuneJob, champion: CausalLM) -> Task | None:
    """REFLOW_TASK's task; unset, none, but for the built-in model, the demo model, which knows
    nothing but the task it was made on (`arith`): its replay and regression set are that task's
    problems, as everyday chat is noise to it."""
    if job.task:
        return get_task(job.task)
    return get_task(BUILTIN_MODEL_TASK) if champion.model_type == BUILTIN else None


def load_version(
    registry: Registry, ref: VersionRef, cache_dir: Path, device: torch.device
) -> tuple[CausalLM, Tokenizer, str]:
    """The version `ref` as a model, its tokenizer, and the version whose weights it runs on: its
    own, or for an adapter (a tenant's own champion) its base's, seen through the adapter."""
    base = registry.tags(ref).get(BASE_VERSION_TAG, "")
    if not base:
        model, tokenizer = load_checkpoint(registry.download(ref, cache_dir), device)
        return model, tokenizer, ref.version
    weights, tokenizer = load_checkpoint(
        registry.download(registry.resolve(ref.name, version=base), cache_dir), device
    )
    adapter = Adapter.load(registry.download(ref, cache_dir), device, weights.dtype)
    return weights.adapted(adapter), tokenizer, base


def recipe_for(job: FinetuneJob, champion: CausalLM) -> FinetuneConfig:
    """The recipe REFLOW_FINETUNE_METHOD picks for this champion (`auto`: LoRA, but a full
    fine-tune for the built-in model). A champion that is an adapter is trained on as one, whatever
    the method."""
    if champion.adapter is not None:
        return job.lora_recipe
    method = job.method if job.method != "auto" else ("full" if champion.model_type == BUILTIN else "lora")
    return job.lora_recipe if method == "lora" else job.recipe


def replay_source(
    task: Task | None, champion: CausalLM, tokenizer: Tokenizer, general: tuple[str, ...]
) -> Callable[[random.Random], Example]:
    """What a run replays against forgetting: the champion's own greedy answers to the `general`
    prompts, computed once; or, for a demo task that knows the answers to its base prompts (arith,
    the built-in model's whole world), those problems with their answers."""
    if task is not None and gate.has_base_answers(task):
        return partial(replay_example, task)
    pool = gate.champion_answers(champion, tokenizer, general)  # empty ones too: they are its own
    return lambda draw: draw.choice(pool)


def _no_thought(_prompt: str) -> None:
    """Without a task, a correction is taught as the bare answer."""
    return None


def _logging_progress(
    run_id: int, progress: Callable[[int, int, float], None] | None
) -> Callable[[int, int, float], None]:
    """`progress`, and a log line every tenth of the run (the scheduler's job has no progress bar)."""
    started = time.perf_counter()

    def report(step: int, total: int, loss: float) -> None:
        if step == total or step % max(1, total // PROGRESS_LOGS) == 0:
            elapsed = time.perf_counter() - started
            logger.info("fine-tune run %d: step %d/%d, loss %.4f, %.0fs", run_id, step, total, loss, elapsed)
        if progress is not None:
            progress(step, total, loss)

    return report


def claim_run(db: Engine, model: str, parent: str, feedback_ids: list[int], tenant: str = "") -> int | None:
    """Records a running run of `model` and marks `feedback_ids` as its items; returns the run's
    id, or None when another fresh run of `model` is running or took some of these items first.

    Insert first, then look: of two jobs starting at once (say a scheduled one and `reflow
    finetune run`), each sees both rows and only the older one goes on, on SQLite and PostgreSQL.
    A run still `running` after STALE_AFTER was killed: it is marked failed, its items released.
    """
    with Session(db) as session, session.begin():
        stale = session.scalars(
            select(FinetuneRun.id).where(
                FinetuneRun.model == model,
                FinetuneRun.status == "running",
                FinetuneRun.started_at <= utcnow() - STALE_AFTER,
            )
        ).all()
        for run_id in stale:
            _mark_failed(session, run_id, f"abandoned: still running after {STALE_AFTER}")
        run = FinetuneRun(
            model=model, tenant=tenant, parent_version=parent, status="running",
            first_feedback_id=min(feedback_ids),
            last_feedback_id=max(feedback_ids), samples=len(feedback_ids), dataset_hash="",
        )  # fmt: skip
        session.add(run)
        session.flush()
        mine = run.id
        mark = (
            update(FeedbackItem)
            .where(FeedbackItem.id.in_(feedback_ids), FeedbackItem.finetune_run_id.is_(None))
            .values(finetune_run_id=mine)
        )
        taken = cast(CursorResult[Any], session.execute(mark)).rowcount
    with Session(db) as session, session.begin():
        oldest = session.scalar(
            select(FinetuneRun.id)
            .where(FinetuneRun.model == model, FinetuneRun.status == "running")
            .order_by(FinetuneRun.id)
            .limit(1)
        )
        if oldest == mine and taken == len(feedback_ids):
            return mine
        _release_in(session, mine)
        session.delete(session.get(FinetuneRun, mine))
    return None


def _mark_failed(session: Session, run_id: int, message: str) -> None:
    run = session.get(FinetuneRun, run_id)
    if run is not None:
        run.status, run.message, run.finished_at = "failed", message, utcnow()
    _release_in(session, run_id)


def _release_in(session: Session, run_id: int) -> None:
    """Gives the items of run `run_id` back to the next run."""
    session.execute(
        update(FeedbackItem).where(FeedbackItem.finetune_run_id == run_id).values(finetune_run_id=None)
    )


def _finish(db: Engine, run_id: int, **fields: object) -> None:
    """Marks run `run_id` finished with `fields` (status, message, results)."""
    metrics = fields.get("metrics")
    if isinstance(metrics, dict):  # JSON has no NaN (PostgreSQL refuses it): none becomes null
        fields["metrics"] = {k: None if v != v else v for k, v in metrics.items()}
    with Session(db) as session, session.begin():
        run = session.get(FinetuneRun, run_id)
        assert run is not None
        for key, value in fields.items():
            setattr(run, key, value)
        run.finished_at = utcnow()
