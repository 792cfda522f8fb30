"""Running A/B experiments as the store holds them: what the gateway assigns by and the evaluate
job decides on."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from reflow.store.tables import Experiment, aware

RUNNING = "running"


@dataclass(frozen=True, kw_only=True)
class RunningExperiment:
    """An experiment, its versions and its split: what a request is assigned and routed by."""

    id: int
    model: str
    tenant: str  # whose own versions it tests, on its traffic alone; "" = the shared model's
    champion_version: str
    challenger_version: str
    traffic: float
    started_at: datetime

    @classmethod
    def of(cls, row: Experiment) -> RunningExperiment:
        """The snapshot of an `experiments` row."""
        return cls(
            id=row.id, model=row.model, tenant=row.tenant, champion_version=row.champion_version,
            challenger_version=row.challenger_version, traffic=row.traffic, started_at=aware(row.started_at),
        )  # fmt: skip


def running_experiments(db: Engine) -> list[RunningExperiment]:
    """Every running experiment, one per model and tenant at most."""
    with Session(db) as session:
        rows = session.scalars(select(Experiment).where(Experiment.status == RUNNING)).all()
        return [RunningExperiment.of(e) for e in rows]


def running_experiment(db: Engine, model: str, tenant: str = "") -> RunningExperiment | None:
    """The running experiment of `model` for `tenant` ("" = the shared model's), if any."""
    with Session(db) as session:
        found = session.scalar(
            select(Experiment).where(
                Experiment.status == RUNNING, Experiment.model == model, Experiment.tenant == tenant
            )
        )
        return None if found is None else RunningExperiment.of(found)
