"""The evaluate job: for each running experiment, the per-arm numbers from the store, the decision
rule, the alias move it calls for, the push to the workers, and a record of it all.

A decision is recorded first, claiming the experiment (`deciding`: no longer assigned, so of two
evaluators only one acts); then the aliases move, then the experiment gets its final status. A
process stopped in between leaves the experiment `deciding`, and the next round applies its
decision again: every step can be repeated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy import Engine

from feedback.experiments.decision import Decision, Rules, decide
from feedback.experiments.lifecycle import DECIDING, ENDED_BY, arm_stats, decided, end, reconcile, record
from feedback.experiments.promotion import promote, push_to_workers, roll_back
from reflow.registry import CHALLENGER, CHAMPION, Registry
from reflow.scopes import learning_scopes, scope_named, unshared_tenant_ids
from reflow.store.experiments import RunningExperiment, running_experiments
from reflow.store.tables import utcnow
from reflow.worker_calls import WorkerTargets

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """One experiment's evaluation: which one, and what was decided."""

    experiment: RunningExperiment
    decision: Decision


@dataclass(frozen=True)
class EvaluateJob:
    """What an evaluation round needs: the model that always gets a look, the decision rule (its
    traffic is the split a new experiment gets; each experiment is judged on its own), and the
    workers to tell when aliases move."""

    model: str
    rules: Rules
    workers: WorkerTargets
    cache_dir: Path  # local copies of versions, for merging a promoted adapter


def evaluate_experiments(job: EvaluateJob, db: Engine, registry: Registry) -> list[Evaluation]:
    """Finishes decisions a stopped process left half applied, opens the experiment a new
    challenger needs (of the shared model, or of a tenant training its own), then evaluates and
    acts on every running one. A scope whose round fails is logged and retried at the next round;
    the others go on. When aliases moved, the workers are told once, at the end."""
    half_applied = decided(db)
    for experiment, look in half_applied:
        logger.info("experiment %d: applying its %s decision again", experiment.id, look.outcome)
        apply(job, db, registry, experiment, look.outcome, look.reason)
    looked_at = {(job.model, scope) for scope in learning_scopes(db)} | {
        (e.model, scope_named(db, e.tenant)) for e in running_experiments(db)
    }
    evaluations = []
    for model, scope in sorted(looked_at, key=lambda pair: (pair[0], pair[1].tenant_id)):
        try:
            running = reconcile(db, registry, model, job.rules.traffic, scope)
            if running is not None and (evaluation := evaluate_one(job, db, registry, running)):
                evaluations.append(evaluation)
        except Exception:
            logger.exception(
                "evaluating the experiment of %s for %s failed; the next round tries again", model, scope
            )
    if half_applied or any(e.decision.outcome != "continue" for e in evaluations):
        push_to_workers(job.workers)
    return evaluations


def evaluate_one(
    job: EvaluateJob, db: Engine, registry: Registry, experiment: RunningExperiment
) -> Evaluation | None:
    """Decides on one experiment, records the decision and applies it; None when another process
    ended the experiment meanwhile."""
    stats = arm_stats(db, experiment.id, job.rules.max_per_user)
    age_s = (utcnow() - experiment.started_at).total_seconds()
    rules = replace(job.rules, traffic=experiment.traffic)
    decision = decide(stats[CHAMPION], stats[CHALLENGER], rules, age_s)
    if not record(db, experiment.id, stats, decision):
        return None
    logger.info(
        "experiment %d (%s v%s vs v%s): %s: %s",
        experiment.id, experiment.model, experiment.champion_version, experiment.challenger_version,
        decision.outcome, decision.reason,
    )  # fmt: skip
    if decision.outcome != "continue":
        apply(job, db, registry, experiment, decision.outcome, decision.reason)
    return Evaluation(experiment, decision)


def apply(
    job: EvaluateJob,
    db: Engine,
    registry: Registry,
    experiment: RunningExperiment,
    outcome: str,
    reason: str,
) -> None:
    """Moves the aliases as `outcome` says and ends the experiment with its final status.
    `promote` makes the challenger the champion (an adapter merged into its base first); every
    other outcome removes the challenger alias, if it still points at this experiment's
    challenger."""
    scope = scope_named(db, experiment.tenant)
    if outcome == "promote":
        unshared = unshared_tenant_ids(db) if not scope.tenant else ()
        promote(registry, experiment.model, experiment.challenger_version, job.cache_dir, scope, unshared)
    else:
        roll_back(registry, experiment.model, experiment.challenger_version, scope)
    end(db, experiment.id, ENDED_BY[outcome], reason, was=DECIDING)
