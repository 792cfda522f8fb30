"""A/B experiments in the store: opening one when a model gets a challenger, the per-arm numbers
an evaluation needs, recording what was decided, and the history the CLI shows.

An experiment exists while a scope (the shared model, or a tenant's own versions: reflow/store/
scopes.py) of a model has both a champion and a challenger alias. It opens when
the fine-tune job registers a challenger or when the scheduler's next evaluation finds one set by
hand; it ends when it decides, or when someone moves the aliases it tests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Engine, Integer, Select, case, func, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from feedback.experiments.decision import ArmStats, Decision
from reflow.registry import CHALLENGER, CHAMPION, Registry
from reflow.scopes import SHARED, Scope, champion_of
from reflow.store.experiments import RUNNING, RunningExperiment, running_experiment
from reflow.store.tables import RATES, Experiment, ExperimentDecision, FeedbackItem, Inference, aware, utcnow

logger = logging.getLogger(__name__)
LATENCY_SAMPLE = 10_000  # the most recent completions per arm the p95 latency is taken over
DECIDING = "deciding"  # decided and claimed, its aliases being moved
# the final status of an experiment, by the outcome that ended it
ENDED_BY = {"promote": "promoted", "rollback": "rolled_back", "invalid": "invalid", "expire": "expired"}


def reconcile(
    db: Engine, registry: Registry, model: str, traffic: float, scope: Scope = SHARED
) -> RunningExperiment | None:
    """Brings the experiment of `model` in `scope` in line with its aliases and returns the running
    one.

    A challenger without an experiment gets one (one running experiment per model and scope, even
    when two processes race: the store's unique index lets one insert win); an experiment whose
    champion or challenger was moved by hand ends as `ended`.
    """
    champion = champion_of(registry, model, scope).version
    try:
        challenger = registry.resolve(model, alias=scope.challenger).version
    except LookupError:
        challenger = None
    current = running_experiment(db, model, scope.tenant)
    if current is not None and (current.champion_version, current.challenger_version) != (
        champion,
        challenger,
    ):
        moved = f"champion is v{champion}, challenger {f'v{challenger}' if challenger else 'none'}"
        end(db, current.id, "ended", f"aliases moved outside the experiment: {moved}")
        current = None
    if current is not None or challenger is None:
        return current
    if challenger == champion:  # a promotion by hand that left the challenger alias behind
        registry.delete_alias(model, scope.challenger)
        return None
    try:
        with Session(db) as session, session.begin():
            experiment = Experiment(
                model=model, tenant=scope.tenant, champion_version=champion, challenger_version=challenger,
                traffic=traffic, status=RUNNING,
            )  # fmt: skip
            session.add(experiment)
            session.flush()
            opened = experiment.id
        logger.info(
            "experiment %d opened for %s: %s v%s (champion) vs v%s (challenger), %.0f%% to the challenger",
            opened, scope, model, champion, challenger, traffic * 100,
        )  # fmt: skip
    except IntegrityError:
        pass  # another process opened it first
    return running_experiment(db, model, scope.tenant)


def end(db: Engine, experiment_id: int, status: str, reason: str, *, was: str = RUNNING) -> bool:
    """Ends an experiment that is still in status `was` with `status` and why; False when it was
    not (another process ended it first)."""
    with db.begin() as connection:
        changed = connection.execute(
            update(Experiment)
            .where(Experiment.id == experiment_id, Experiment.status == was)
            .values(status=status, reason=reason, ended_at=utcnow())
        ).rowcount
    if changed:
        logger.info("experiment %d %s: %s", experiment_id, status, reason)
    return bool(changed)


def arm_stats(db: Engine, experiment_id: int, max_per_user: int) -> dict[str, ArmStats]:
    """What each arm of the experiment saw, from the inferences it assigned and their feedback.

    A completion counts as rated when it has a non-zero rating, and as positive when one of its
    ratings is +1. Units are distinct users of a tenant (two tenants' users of the same id are
    different people; a request without a user is a unit of its own): the sample ratio check is on
    what was randomized, and the ratings are grouped by unit, each weighing at most `max_per_user`
    responses (feedback.experiments.decision).
    """
    of_experiment = Inference.experiment_id == experiment_id
    unit = case((Inference.user_id != "", Inference.user_id), else_=Inference.request_id)
    errors = func.sum(case((Inference.finish_reason == "ERROR", 1), else_=0))
    best = (
        select(
            Inference.arm, Inference.tenant, unit.label("unit"), func.max(FeedbackItem.rating).label("best")
        )
        .join(FeedbackItem, RATES)
        .where(of_experiment, FeedbackItem.rating != 0)
        .group_by(Inference.request_id, Inference.arm, Inference.tenant, Inference.user_id)
        .subquery()
    )
    with Session(db) as session:
        traffic = session.execute(
            select(
                Inference.arm, func.count(), errors, func.count((Inference.tenant + " " + unit).distinct())
            )
            .where(of_experiment)
            .group_by(Inference.arm)
        ).all()
        per_unit = session.execute(
            select(
                best.c.arm, func.count(), func.sum(case((best.c.best > 0, 1), else_=0)).cast(Integer)
            ).group_by(best.c.arm, best.c.tenant, best.c.unit)
        ).all()
        stats: dict[str, ArmStats] = {}
        for arm in (CHAMPION, CHALLENGER):
            requests, failed, units = next(((n, e, u) for a, n, e, u in traffic if a == arm), (0, 0, 0))
            latencies = session.scalars(
                select(Inference.total_ms)
                .where(of_experiment, Inference.arm == arm, Inference.finish_reason != "ERROR")
                .order_by(Inference.created_at.desc())
                .limit(LATENCY_SAMPLE)
            ).all()
            stats[arm] = ArmStats(
                rated=0, positive=0, requests=requests, errors=int(failed or 0), units=units,
                p95_latency_ms=percentile(latencies, 0.95),
            ).with_ratings([(n, p) for a, n, p in per_unit if a == arm], max_per_user)  # fmt: skip
    return stats


def variant_mix(db: Engine, experiment_id: int) -> dict[str, dict[str, int]]:
    """Each arm's completions by the variant that served them ("" where its workers held none):
    variants are chosen inside an arm, per request, to meet its deadline (docs/latency.md)."""
    with Session(db) as session:
        rows = session.execute(
            select(Inference.arm, Inference.variant, func.count())
            .where(Inference.experiment_id == experiment_id, Inference.finish_reason != "ERROR")
            .group_by(Inference.arm, Inference.variant)
        ).all()
    mix: dict[str, dict[str, int]] = {CHAMPION: {}, CHALLENGER: {}}
    for arm, variant, n in rows:
        mix.setdefault(arm, {})[variant] = n
    return mix


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile by the nearest-rank method; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def record(db: Engine, experiment_id: int, stats: dict[str, ArmStats], decision: Decision) -> bool:
    """Stores one evaluation with its numbers, if the experiment is still running. An outcome that
    ends it also claims it, moving it to `deciding` (no longer assigned, not yet applied), so of two
    evaluators racing only one acts. False when the experiment was no longer running."""
    with Session(db) as session, session.begin():
        claim = (
            update(Experiment)
            .where(Experiment.id == experiment_id, Experiment.status == RUNNING)
            .values(status=DECIDING if decision.outcome in ENDED_BY else RUNNING)
        )
        claimed = cast(CursorResult[Any], session.execute(claim)).rowcount
        if not claimed:
            return False
        session.add(
            ExperimentDecision(
                experiment_id=experiment_id, outcome=decision.outcome, reason=decision.reason,
                champion=asdict(stats[CHAMPION]), challenger=asdict(stats[CHALLENGER]),
                likelihood_ratio=decision.likelihood_ratio, difference=decision.difference,
                srm_p=decision.srm_p,
            )
        )  # fmt: skip
    return True


def decided(db: Engine) -> list[tuple[RunningExperiment, Look]]:
    """Experiments whose decision was recorded but not yet applied (its process stopped between
    the two), with that decision."""
    with Session(db) as session:
        rows = _with_latest_look(session, select(Experiment).where(Experiment.status == DECIDING))
        return [(RunningExperiment.of(e), look) for e, look in rows if look is not None]


@dataclass(frozen=True, kw_only=True)
class Look:
    """One recorded evaluation, as `experiments show` and the report present it."""

    at: datetime
    outcome: str
    reason: str
    champion: ArmStats
    challenger: ArmStats
    likelihood_ratio: float
    difference: float
    srm_p: float


def _look(row: ExperimentDecision) -> Look:
    return Look(
        at=aware(row.decided_at), outcome=row.outcome, reason=row.reason,
        champion=ArmStats(**row.champion), challenger=ArmStats(**row.challenger),
        likelihood_ratio=row.likelihood_ratio, difference=row.difference, srm_p=row.srm_p,
    )  # fmt: skip


def history(db: Engine, experiment_id: int) -> tuple[Experiment, list[Look]]:
    """An experiment and every evaluation of it, oldest first; LookupError when there is none."""
    with Session(db) as session:
        experiment = session.get(Experiment, experiment_id)
        if experiment is None:
            raise LookupError(f"there is no experiment {experiment_id}")
        rows = session.scalars(
            select(ExperimentDecision)
            .where(ExperimentDecision.experiment_id == experiment_id)
            .order_by(ExperimentDecision.id)
        ).all()
        looks = [_look(r) for r in rows]
        session.expunge(experiment)
    return experiment, looks


def experiments(db: Engine, model: str | None = None) -> list[tuple[Experiment, Look | None]]:
    """Every experiment (of `model`), newest first, with its latest evaluation."""
    with Session(db) as session:
        query = select(Experiment).order_by(Experiment.id.desc())
        if model:
            query = query.where(Experiment.model == model)
        found = _with_latest_look(session, query)
        session.expunge_all()
    return found


def _with_latest_look(session: Session, query: Select[Experiment]) -> list[tuple[Experiment, Look | None]]:
    """The experiments `query` selects, each with its latest evaluation, in one query."""
    latest = (
        select(ExperimentDecision.experiment_id, func.max(ExperimentDecision.id).label("id"))
        .group_by(ExperimentDecision.experiment_id)
        .subquery()
    )
    rows = session.execute(
        query.add_columns(ExperimentDecision)
        .outerjoin(latest, latest.c.experiment_id == Experiment.id)
        .outerjoin(ExperimentDecision, ExperimentDecision.id == latest.c.id)
    ).all()
    return [(experiment, None if decision is None else _look(decision)) for experiment, decision in rows]
