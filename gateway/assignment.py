"""The gateway's view of running experiments: which arm a request gets, and where that arm runs.

The view is re-read from the store at most every `poll_s`, in the background of the request that
finds it stale, so no request waits on the store. A request takes part in its model's experiment
when it names the model without an alias or version, and only once a worker serves the
challenger: until then everyone gets the champion and nothing is counted, so the experiment's
split is never skewed by a challenger still loading.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass

from sqlalchemy import Engine

from gateway.routing import ModelSpec, WorkerPool
from reflow.registry import CHALLENGER, CHAMPION
from reflow.store.experiments import RunningExperiment, running_experiments

logger = logging.getLogger(__name__)


def assigned_arm(experiment_id: int, unit: str, traffic: float) -> str:
    """The arm of assignment unit `unit` (a user id, else a request id): the same unit always gets
    the same arm within an experiment, and about `traffic` of all units get the challenger."""
    digest = hashlib.sha256(f"{experiment_id}:{unit}".encode()).digest()
    return CHALLENGER if int.from_bytes(digest[:8], "big") < traffic * 2**64 else CHAMPION


@dataclass
class Assignment:
    """Where one request goes: the spec to route, its arm, and the experiment that chose it."""

    spec: ModelSpec
    arm: str
    experiment: RunningExperiment | None = None

    def fall_back_to_champion(self) -> None:
        """The challenger went away under the request (rolled back): the champion answers, and the
        request no longer counts in the experiment."""
        self.spec, self.arm, self.experiment = ModelSpec(self.spec.name, alias=CHAMPION), CHAMPION, None


class ExperimentView:
    """Running experiments by model, refreshed from the store without blocking requests."""

    def __init__(self, engine: Engine, poll_s: float) -> None:
        self.engine = engine
        self.poll_s = poll_s
        self.by_model: dict[str, RunningExperiment] = {}
        self._loaded_at = float("-inf")
        self._refreshing: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """Re-reads the running experiments; on a store error the last view stays."""
        try:
            found = await asyncio.to_thread(running_experiments, self.engine)
        except Exception:
            logger.exception("could not read running experiments; keeping the last view")
            return
        finally:
            self._loaded_at = time.monotonic()
        self.by_model = {e.model: e for e in found}

    def _refresh_if_stale(self) -> None:
        stale = time.monotonic() - self._loaded_at > self.poll_s
        if stale and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self.refresh(), name="experiments-refresh")

    def assign(self, requested: str, spec: ModelSpec, unit: str, pool: WorkerPool) -> Assignment:
        """The assignment of a request for `requested` (the model field as sent) whose sticky unit
        is `unit` (its user id, else its request id)."""
        self._refresh_if_stale()
        experiment = self.by_model.get(spec.name)
        explicit = "@" in requested or "/" in requested
        if experiment is None or explicit or spec.alias != CHAMPION:
            return Assignment(spec, spec.alias)
        if not pool.serves(ModelSpec(spec.name, alias=CHALLENGER), version=experiment.challenger_version):
            return Assignment(spec, spec.alias)  # not loaded yet, or already rolled back on the workers
        challenger = ModelSpec(spec.name, version=experiment.challenger_version)
        if assigned_arm(experiment.id, unit, experiment.traffic) == CHALLENGER:
            return Assignment(challenger, CHALLENGER, experiment)
        return Assignment(spec, CHAMPION, experiment)
