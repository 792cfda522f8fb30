"""The fine-tune job: new labelled feedback → a candidate trained from the champion → the gate →
an MLflow run, and a new version with alias `challenger` when the candidate passed.

Every run that starts is recorded in `finetune_runs`; a finished run (registered or rejected)
marks the feedback it considered as used, so the next run waits for new feedback.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from feedback import arith, gate
from feedback.dataset import (
    Example,
    RatedCompletion,
    build_dataset,
    count_new,
    last_consumed_feedback_id,
    load_new,
)
from feedback.finetune import FinetuneConfig, train_candidate
from feedback.pretrain import PretrainConfig
from feedback.registry import Registry
from feedback.store import FinetuneRun, utcnow
from reflow.settings import Settings
from workers.loading import resolve_device
from workers.model import Transformer
from workers.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)
CHALLENGER = "challenger"
STALE_AFTER = timedelta(minutes=30)  # a `running` row older than this belongs to a killed job


@dataclass(frozen=True)
class Outcome:
    """What a call of `run_finetune` did: skipped, registered, rejected (with why), or failed."""

    status: str
    message: str
    run: int | None = None  # finetune_runs.id
    version: str = ""
    metrics: dict[str, float] | None = None


def finetune_config(settings: Settings, seed: int = 0) -> FinetuneConfig:
    """The recipe, with the sizes, steps and learning rate the settings give."""
    return FinetuneConfig(
        steps=settings.finetune_steps,
        batch_size=settings.finetune_batch_size,
        lr=settings.finetune_lr,
        seed=seed,
    )


def canonical_thought(prompt: str) -> str | None:
    """The reasoning a correction is taught with: `arith`'s for its prompts, none for others."""
    operands = arith.parse_prompt(prompt)
    return arith.reasoning(*operands) if operands else None


def base_problem(rng: random.Random) -> Example:
    """A problem from the base model's training distribution, replayed against forgetting."""
    base = PretrainConfig()
    a, b = rng.randint(base.lo, base.hi), rng.randint(base.lo, base.hi)
    return Example(arith.format_prompt(a, b), arith.reasoning(a, b), str(a + b))


def run_finetune(
    settings: Settings,
    engine: Engine,
    registry: Registry,
    *,
    model: str | None = None,
    min_samples: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> Outcome:
    """Fine-tunes `model`'s champion on the labelled feedback that arrived since the last run."""
    name = model or settings.model_name
    needed = settings.finetune_min_samples if min_samples is None else min_samples
    after = last_consumed_feedback_id(engine, name)
    new = count_new(engine, name, after)
    if new < max(needed, 1):
        return Outcome("skipped", f"{new} new labelled feedback item(s) on {name}; waiting for {needed}")
    champion_ref = registry.resolve(name, alias=settings.model_alias)
    items = load_new(engine, name, after)
    run_id = claim_run(engine, name, champion_ref.version, items[0].id, items[-1].id)
    if run_id is None:
        return Outcome("skipped", "another fine-tune run is in progress")
    try:
        outcome = _train_and_judge(
            settings, engine, registry, run_id, champion_ref.version, name, items, progress
        )
    except Exception as error:
        logger.exception("fine-tune run %d failed", run_id)
        _finish(engine, run_id, status="failed", message=f"{type(error).__name__}: {error}")
        return Outcome("failed", str(error), run_id)
    return outcome


def _train_and_judge(
    settings: Settings,
    engine: Engine,
    registry: Registry,
    run_id: int,
    parent: str,
    name: str,
    items: list[RatedCompletion],
    progress: Callable[[int, int, float], None] | None,
) -> Outcome:
    started = time.perf_counter()
    first_id, last_id = items[0].id, items[-1].id
    rng = random.Random(run_id)
    if len(items) > settings.finetune_max_samples:  # a small sample of what is new
        items = sorted(rng.sample(items, settings.finetune_max_samples), key=lambda item: item.id)
    dataset = build_dataset(items, settings.finetune_holdout_fraction, canonical_thought)
    device = resolve_device(settings.device)
    champion = Transformer.load(
        registry.download(registry.resolve(name, version=parent), settings.model_cache_dir), device
    )
    config = finetune_config(settings, seed=run_id)
    candidate, history = train_candidate(champion, dataset, base_problem, config, progress)
    train_s = time.perf_counter() - started
    logger.info("fine-tune run %d trained in %.1fs on %d items", run_id, train_s, dataset.size)
    before, after = gate.evaluate(champion, dataset.held_out), gate.evaluate(candidate, dataset.held_out)
    logger.info("fine-tune run %d evaluated in %.1fs", run_id, time.perf_counter() - started - train_s)
    verdict = gate.judge(before, after, settings.finetune_regression_tolerance)
    metrics = {
        **{f"champion_{k}": v for k, v in before.items()},
        **{f"candidate_{k}": v for k, v in after.items()},
        "samples": float(dataset.size), "supervised_examples": float(len(dataset.supervised)),
        "rated_examples": float(dataset.rated), "train_seconds": train_s,
    }  # fmt: skip
    params = {
        **asdict(config), "parent_version": parent, "feedback_first_id": first_id,
        "feedback_last_id": last_id, "dataset_size": dataset.size, "dataset_sha256": dataset.digest,
        "holdout_fraction": settings.finetune_holdout_fraction,
        "regression_tolerance": settings.finetune_regression_tolerance, "device": str(device),
    }  # fmt: skip
    curves = {
        f"train_{field}": [getattr(s, field) for s in history] for field in ("loss", "sft", "kto", "kl")
    }
    tags = {"reflow.source": "finetune", "reflow.parent_version": parent, "reflow.verdict": verdict.reason}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        candidate.save(directory)
        ByteTokenizer().save(directory)
        mlflow_run, source = registry.log_run(
            f"{name}-finetune-{run_id}", params=params, metrics=metrics, model_dir=directory,
            history=curves, tags=tags,
        )  # fmt: skip
    version = ""
    if verdict.register:
        version = registry.register_version(
            name, mlflow_run, source, alias=CHALLENGER,
            tags={"reflow.parent_version": parent, "reflow.run_id": mlflow_run,
                  "reflow.finetune_run": str(run_id)},
        ).version  # fmt: skip
    status = "registered" if verdict.register else "rejected"
    _finish(
        engine, run_id, status=status, message=verdict.reason, samples=dataset.size,
        dataset_hash=dataset.digest, mlflow_run_id=mlflow_run, version=version, metrics=metrics,
    )  # fmt: skip
    logger.info("fine-tune run %d %s: %s", run_id, status, verdict.reason)
    return Outcome(status, verdict.reason, run_id, version, metrics)


def claim_run(engine: Engine, model: str, parent: str, first_id: int, last_id: int) -> int | None:
    """Records a running run and returns its id; None while another fresh run of `model` runs.

    Insert first, then look: of two jobs starting at once (say a scheduled one and `reflow
    finetune run`), each sees both rows and only the older one goes on, on SQLite and PostgreSQL.
    """
    with Session(engine) as session, session.begin():
        run = FinetuneRun(
            model=model, parent_version=parent, status="running", first_feedback_id=first_id,
            last_feedback_id=last_id, samples=0, dataset_hash="",
        )  # fmt: skip
        session.add(run)
        session.flush()
        mine = run.id
    with Session(engine) as session, session.begin():
        oldest = session.scalar(
            select(FinetuneRun.id)
            .where(
                FinetuneRun.model == model,
                FinetuneRun.status == "running",
                FinetuneRun.started_at > utcnow() - STALE_AFTER,
            )
            .order_by(FinetuneRun.id)
            .limit(1)
        )
        if oldest != mine:
            session.delete(session.get(FinetuneRun, mine))
            return None
    return mine


def _finish(engine: Engine, run_id: int, **fields: object) -> None:
    """Marks run `run_id` finished with `fields` (status, message, results)."""
    with Session(engine) as session, session.begin():
        run = session.get(FinetuneRun, run_id)
        assert run is not None
        for key, value in fields.items():
            setattr(run, key, value)
        run.finished_at = utcnow()
